"""Test setup: 8 simulated CPU devices and a compilation cache shared by the whole run."""

import os
import pathlib

import jax
import pytest

# LLVM's optimizations off for the CPU programs the tests compile (and, through the
# environment, the train.py and server processes they start): compiling, not running,
# is most of the suite's time on 2 cores, and this takes 30-40% off a cold compile
# (tests/test_parallel.py: 78 -> 47 s). XLA's own passes still run, so the programs are
# the same computations. Read when the backend starts, after this file.
CPU_XLA_FLAGS = '--xla_backend_optimization_level=0'

jax.config.update('jax_num_cpu_devices', 8)
# MESHLM_TEST_GPU=1 keeps the GPU for the kernel tests (benchmarks/gpu_session.sh); the
# rest of the suite needs the 8 simulated CPU devices.
if not os.environ.get('MESHLM_TEST_GPU'):
  jax.config.update('jax_platforms', 'cpu')
  if CPU_XLA_FLAGS not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {CPU_XLA_FLAGS}'.strip()
_CACHE = pathlib.Path(os.environ.get('MESHLM_TEST_CACHE',
                                     pathlib.Path(__file__).parent.parent / '.pytest_cache' / 'jax'))
jax.config.update('jax_compilation_cache_dir', str(_CACHE))
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
# The same cache for the processes tests start (README commands, train.py, the server):
# a program one of them compiled is not compiled again by the next.
os.environ['JAX_COMPILATION_CACHE_DIR'] = str(_CACHE)
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'


def pytest_addoption(parser):
  parser.addoption('--stress-seeds', type=int, default=None, metavar='N',
                   help='tests/test_serve_stress.py: run seeds 0..N-1 (default: its CI few)')
  parser.addoption('--layout-matrix', default=None, metavar='N|all',
                   help='tests/test_layout_matrix.py: sample N combinations, or all')


def pytest_configure(config):
  del config
  # Grain's multiprocessing workers read absl flags; pytest never parses them.
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.FLAGS.mark_as_parsed()


# The files that take longest (from a cold cache about 10, 2.5, 2 and 2.5 minutes of one
# core of the ~37 the suite's tests take): run first, so that `-n 2 --dist loadfile`, which
# hands each worker whole files in collection order, does not end on one worker running a
# long file alone.
LONGEST_FIRST = ('test_flash_attention_mgpu.py', 'test_planner.py', 'test_readme.py',
                 'test_fault_tolerance.py', 'test_benchmarks.py')


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: order kept


# What a test may not leave changed: the variables that steer jax, XLA, Python imports and
# meshlm in this worker's later tests and the processes they start. (Libraries set others
# of their own on import, e.g. tensorboardX's CRC32C_SW_MODE: not a test's doing.)
_GUARDED = ('PYTHONPATH', 'XLA_FLAGS', 'JAX_', 'MESHLM_', 'CUDA_VISIBLE_DEVICES')


@pytest.fixture(autouse=True)
def environment_unchanged(request):
  """A test that changes these variables outside monkeypatch fails: its change would
  leak into every later test of the worker (and their subprocesses)."""
  before = {k: v for k, v in os.environ.items() if k.startswith(_GUARDED)}
  yield
  after = {k: v for k, v in os.environ.items() if k.startswith(_GUARDED)}
  changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
  if changed:
    for k in changed:
      if k in before:
        os.environ[k] = before[k]
      else:
        del os.environ[k]
    pytest.fail(f'{request.node.nodeid} changed os.environ ({", ".join(changed)}) without '
                'restoring it: use monkeypatch.setenv.', pytrace=False)


pytest_plugins = ['tests.serve_fixtures']
