"""Test setup: 8 simulated CPU devices and a compilation cache shared by the whole run."""

import os
import pathlib

import jax

jax.config.update('jax_num_cpu_devices', 8)
# MESHLM_TEST_GPU=1 keeps the GPU for the kernel tests (benchmarks/gpu_session.sh); the
# rest of the suite needs the 8 simulated CPU devices.
if not os.environ.get('MESHLM_TEST_GPU'):
  jax.config.update('jax_platforms', 'cpu')
_CACHE = pathlib.Path(os.environ.get('MESHLM_TEST_CACHE',
                                     pathlib.Path(__file__).parent.parent / '.pytest_cache' / 'jax'))
jax.config.update('jax_compilation_cache_dir', str(_CACHE))
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def pytest_configure(config):
  del config
  # Grain's multiprocessing workers read absl flags; pytest never parses them.
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.FLAGS.mark_as_parsed()
pytest_plugins = ['tests.serve_fixtures']
