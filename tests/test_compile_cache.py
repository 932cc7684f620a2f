"""The persistent compilation cache of the command lines (training/compile_cache.py): a
second process reads what the first compiled; 'none' leaves it off; a directory the
process already has wins; a directory that cannot be made is refused by name, by
train.py and by the serving CLIs."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each process compiles the same few programs after enable() and prints the directory in
# use, its cache hits and the programs it built.
SCRIPT = """
import sys
import jax, jax.numpy as jnp
from training import compile_cache
where = compile_cache.enable(sys.argv[1])
jax.jit(lambda x: jnp.tanh(x @ x.T) * 3)(jnp.ones((64, 64))).block_until_ready()
print(repr(where), compile_cache.hits(), compile_cache.programs())
"""


def _env(**extra) -> dict:
  """The suite's environment without its own cache directory (tests/conftest.py sets
  one for every process it starts), with HOME moved so the default lands in tmp."""
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  env.update(JAX_PLATFORMS='cpu', JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0', **extra)
  return env


def _run(args, env, timeout=120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def _script(path, env) -> tuple[str, int, int]:
  result = _run(['-c', SCRIPT, path], env)
  assert result.returncode == 0, result.stderr[-2000:]
  where, hits, lookups = result.stdout.split()
  return eval(where), int(hits), int(lookups)   # pylint: disable=eval-used


def test_a_second_process_reads_the_first_ones_program(tmp_path):
  env = _env(HOME=str(tmp_path / 'home'))
  default = str(tmp_path / 'home' / '.cache' / 'meshlm' / 'jax')
  where, hits, programs = _script('~/.cache/meshlm/jax', env)
  assert (where, hits) == (default, 0) and programs >= 1   # '~' expanded, the dir made
  assert os.listdir(default)   # the programs, written
  assert _script('~/.cache/meshlm/jax', env) == (default, programs, programs)
  # Off: nothing read, nothing made.
  assert _script('none', env) == ('', 0, programs)
  assert _script('', env) == ('', 0, programs)
  # A directory the process already has (jax's own variable) wins over the one asked for.
  mine = str(tmp_path / 'mine')
  env_mine = {**env, 'JAX_COMPILATION_CACHE_DIR': mine}
  assert _script(str(tmp_path / 'asked'), env_mine) == (mine, 0, programs)
  assert not (tmp_path / 'asked').exists()


def test_a_directory_that_cannot_be_made_is_refused_by_name(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('not a directory')
  bad = str(blocker / 'cache')
  env = _env(HOME=str(tmp_path))
  train = _run(['train.py', '--config=default.py:tiny',
                f'--config.compilation_cache_dir={bad}'], env)
  assert train.returncode == 2, train.stderr[-2000:]
  assert f'error: --config.compilation_cache_dir={bad}: cannot create it' in train.stderr
  assert "or 'none'" in train.stderr and 'Traceback' not in train.stderr
  for module in ('serve', 'serve.generate'):
    extra = ['--prompts', 'p.jsonl', '--output', 'o.jsonl'] if module == 'serve.generate' else []
    served = _run(['-m', module, '--checkpoint', str(tmp_path / 'no_such_run'),
                   '--compilation-cache-dir', bad, *extra], env)
    assert served.returncode == 2, (module, served.stderr[-2000:])
    assert f'error: --compilation-cache-dir={bad}: cannot create it' in served.stderr, (
        module, served.stderr[-2000:])
