"""The persistent compilation cache of the command lines (sharding/compile_cache.py): a
second process reads what the first compiled; 'none' leaves it off; a directory the
process already has wins (and a named one it overrides is reported); a named directory
that cannot be made is refused by name by train.py and the serving CLIs, while an
unusable default is a warning; `fresh` gives a block its own cache and takes it away."""

import contextlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each process compiles the same few programs after enable() and prints the directory in
# use, its cache hits and the programs it built.
SCRIPT = """
import sys
import jax, jax.numpy as jnp
from sharding import compile_cache
where = compile_cache.enable(sys.argv[1])
jax.jit(lambda x: jnp.tanh(x @ x.T) * 3)(jnp.ones((64, 64))).block_until_ready()
print(repr(where), compile_cache.hits(), compile_cache.programs())
"""

# fresh(): inside, a second jit of the same program reads the first's from the cache;
# after, no directory is left set (a compile then warns of no missing directory).
FRESH = """
import jax, jax.numpy as jnp
from sharding import compile_cache
f = lambda x: jnp.tanh(x @ x.T) * 3
with compile_cache.fresh() as path:
  inside = jax.config.jax_compilation_cache_dir
  for _ in range(2):
    jax.jit(lambda x: f(x))(jnp.ones((64, 64))).block_until_ready()
print(inside == path, compile_cache.hits(), jax.config.jax_compilation_cache_dir)
jax.jit(lambda x: f(x) + 1)(jnp.ones((64, 64))).block_until_ready()
"""


def _env(**extra) -> dict:
  """The suite's environment without its own cache directory (tests/conftest.py sets
  one for every process it starts)."""
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  env.update(JAX_PLATFORMS='cpu', JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0', **extra)
  return env


def _run(args, env, timeout=120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def _script(path, env) -> tuple[tuple[str, int, int], str]:
  result = _run(['-c', SCRIPT, path], env)
  assert result.returncode == 0, result.stderr[-2000:]
  where, hits, programs = result.stdout.split()
  return (eval(where), int(hits), int(programs)), result.stderr   # pylint: disable=eval-used


def test_a_second_process_reads_the_first_ones_program(tmp_path):
  env = _env(HOME=str(tmp_path / 'home'))
  default = str(tmp_path / 'home' / '.cache' / 'meshlm' / 'jax')
  (where, hits, programs), _ = _script('~/.cache/meshlm/jax', env)
  assert (where, hits) == (default, 0) and programs >= 1   # '~' expanded, the dir made
  assert os.listdir(default)   # the programs, written
  assert _script('~/.cache/meshlm/jax', env)[0] == (default, programs, programs)
  # Off: nothing read.
  assert _script('none', env)[0] == ('', 0, programs)
  assert _script('', env)[0] == ('', 0, programs)
  # A directory the process already has (jax's own variable) wins over the one named,
  # which is said; the default gives way without a word.
  mine = str(tmp_path / 'mine')
  env_mine = {**env, 'JAX_COMPILATION_CACHE_DIR': mine}
  got, err = _script(str(tmp_path / 'asked'), env_mine)
  assert got == (mine, 0, programs) and not (tmp_path / 'asked').exists()
  assert f'is not used: JAX_COMPILATION_CACHE_DIR (or jax.config) already keeps the ' \
         f'compilation cache in {mine}' in err
  got, err = _script('~/.cache/meshlm/jax', env_mine)
  assert got == (mine, programs, programs) and 'is not used' not in err


def test_an_unusable_default_is_a_warning_not_an_error(tmp_path):
  home = tmp_path / 'home'
  home.write_text('a file where the home directory should be')
  got, err = _script('~/.cache/meshlm/jax', _env(HOME=str(home)))
  assert got[:2] == ('', 0)
  assert 'warning: --compilation-cache-dir=' in err and 'compiling every program afresh' in err


def test_fresh_gives_a_block_its_own_cache_and_takes_it_away():
  result = _run(['-c', FRESH], _env())
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ['True', '1', 'None']
  assert 'Error writing persistent compilation cache' not in result.stderr


def test_the_serving_benchmark_starts_with_a_fresh_cache(monkeypatch):
  """serve_throughput's two engine starts compare a cold one with one from the cache:
  its main runs the benchmark inside compile_cache.fresh()."""
  from benchmarks import serve_throughput   # pylint: disable=import-outside-toplevel
  seen = []

  @contextlib.contextmanager
  def fresh():
    seen.append('entered')
    yield 'somewhere'
    seen.append('left')

  monkeypatch.setattr(serve_throughput.compile_cache, 'fresh', fresh)
  monkeypatch.setattr(serve_throughput, 'benchmark',
                      lambda *args: seen.append('benchmark') or {'ratios': {}})
  serve_throughput.main(['--smoke'])
  assert seen == ['entered', 'benchmark', 'left']


def test_a_named_directory_that_cannot_be_made_is_refused_by_name(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('not a directory')
  bad = str(blocker / 'cache')
  env = _env(HOME=str(tmp_path))
  train = _run(['train.py', '--config=default.py:tiny',
                f'--config.compilation_cache_dir={bad}'], env)
  assert train.returncode == 2, train.stderr[-2000:]
  assert f'error: --config.compilation_cache_dir={bad}: cannot create or write it' in (
      train.stderr)
  assert "or 'none'" in train.stderr and 'Traceback' not in train.stderr
  for module in ('serve', 'serve.generate'):
    extra = ['--prompts', 'p.jsonl', '--output', 'o.jsonl'] if module == 'serve.generate' else []
    served = _run(['-m', module, '--checkpoint', str(tmp_path / 'no_such_run'),
                   '--compilation-cache-dir', bad, *extra], env)
    assert served.returncode == 2, (module, served.stderr[-2000:])
    assert f'error: --compilation-cache-dir={bad}: cannot create or write it' in (
        served.stderr), (module, served.stderr[-2000:])


def test_the_batch_cli_keeps_its_programs_where_it_is_told(tiny_workdir, tmp_path):
  """`python -m serve.generate --compilation-cache-dir DIR`: the programs land in DIR."""
  (tmp_path / 'in.jsonl').write_text('{"prompt": "ab", "max_tokens": 2}\n')
  cache = tmp_path / 'cache'
  result = _run(['-m', 'serve.generate', '--checkpoint', tiny_workdir, '--prompts',
                 str(tmp_path / 'in.jsonl'), '--output', str(tmp_path / 'out.jsonl'),
                 '--num-blocks', '16', '--compilation-cache-dir', str(cache)], _env(),
                timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert (tmp_path / 'out.jsonl').exists() and len(os.listdir(cache)) >= 2
