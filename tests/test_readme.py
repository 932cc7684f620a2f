"""Every shell command in the code blocks of README.md and docs/*.md runs as written, on one
CPU device.

Commands are parsed from the files, so one added later is covered too. Each code block
runs in order in its own temporary directory (relative paths such as runs/ and data/ land
there; each holds a copy of README.md, the data example's input). `python train.py`
commands are sized with `--check` first; those not marked (GPU) then train for 2 steps.
Commands marked (GPU) or (server), the install, the test suite itself and the docs build
are skipped by name.
"""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_PREFIXES = {'pip install': 'the install (CI runs it first)',
                 'python -m pytest': "the test suite (this test's own runner)",
                 'python -m sphinx': 'the docs build (tests/test_docs.py runs it)'}
# An absl log record (`W1124 15:38:09.485875 1398... file.py:32] ...`): user messages
# must print as plain lines.
ABSL_RECORD = re.compile(r'^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]', re.M)


def readme_blocks(path=os.path.join(ROOT, 'README.md')) -> list[list[str]]:
  """The commands of each ```bash block: continuation lines joined, comments kept, a
  here-document (`<<'EOF'` ... `EOF`) kept whole in its command."""
  blocks = re.findall(r'```bash\n(.*?)```', open(path, encoding='utf-8').read(), re.S)
  return [_commands(block.replace('\\\n', ' ').splitlines()) for block in blocks]


def _commands(lines: list[str]) -> list[str]:
  commands, heredoc = [], None
  for line in lines:
    if heredoc is not None:
      commands[-1] += '\n' + line
      heredoc = None if line.strip() == heredoc else heredoc
    elif line.strip():
      commands.append(line.strip())
      match = re.search(r"<<'?(\w+)'?", line)
      heredoc = match.group(1) if match else None
  return commands


def doc_files() -> list[str]:
  """README.md, then every docs page, as paths relative to the repository."""
  pages = glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True)
  return ['README.md'] + sorted(os.path.relpath(p, ROOT) for p in pages)


def all_blocks() -> dict[tuple[str, int], list[str]]:
  """{(file, block index): its commands} over README.md and the docs."""
  return {(name, i): block for name in doc_files()
          for i, block in enumerate(readme_blocks(os.path.join(ROOT, name)))}


BLOCKS = all_blocks()
CASES = [(key, j) for key, block in BLOCKS.items() for j in range(len(block))]


def skip_reason(command: str) -> str | None:
  if '(server)' in command:
    return 'needs a running server'
  for prefix, why in SKIP_PREFIXES.items():
    if command.startswith(prefix):
      return why
  return None


def split(command: str) -> tuple[dict, list[str]]:
  """(environment assignments, argv) of one command line, comment dropped."""
  words = shlex.split(command, comments=True)
  env = {}
  while words and re.fullmatch(r'[A-Z_][A-Z0-9_]*=.*', words[0]):
    key, _, value = words.pop(0).partition('=')
    env[key] = value
  return env, words


def run(argv, env, cwd):
  result = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, 'JAX_PLATFORMS': 'cpu', **env})
  output = result.stdout + result.stderr
  assert result.returncode == 0, f'{argv}:\n{output[-3000:]}'
  assert not ABSL_RECORD.search(output), f'absl log record in the output of {argv}:\n{output}'
  return output


def run_command(command: str, cwd, cache_dir) -> None:
  if not command.startswith(('python', 'JAX_')):   # plain shell: files the next ones use
    subprocess.run(['bash', '-c', command], cwd=cwd, check=True, timeout=60)
    return
  env, words = split(command)
  env.setdefault('JAX_NUM_CPU_DEVICES', '1')   # one device unless the README says more
  argv = words[1:]
  if argv[0] == 'train.py':
    argv[0] = os.path.join(ROOT, 'train.py')
    if '--check' in argv or '--help' in argv:
      run(argv, env, cwd)
      return
    run([*argv, '--check'], env, cwd)
    if '(GPU)' in command:
      return
    argv += ['--config.steps=2', '--config.sample.num_tokens=4',
             '--config.metrics.progress_bar=False', f'--config.data.cache_dir={cache_dir}',
             '--config.data.corpus_max_mb=1']
  elif '(GPU)' in command:
    pytest.skip(f'needs a GPU: {command}')
  run(argv, env, cwd)


def block_dir(key: tuple[str, int]) -> str:
  return f'{key[0].replace(os.sep, "_")}-{key[1]}'


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
  """One directory per code block, holding README.md (an input of the data example)."""
  root = tmp_path_factory.mktemp('readme')
  for key in BLOCKS:
    (root / block_dir(key)).mkdir()
    (root / block_dir(key) / 'README.md').write_text(
        open(os.path.join(ROOT, 'README.md')).read())
  return root


@pytest.mark.parametrize('block, index', CASES,
                         ids=[f'{key[0]}:{BLOCKS[key][j][:60]}' for key, j in CASES])
def test_readme_command(block, index, workspace):
  command = BLOCKS[block][index]
  reason = skip_reason(command)
  if reason:
    pytest.skip(f'{reason}: {command}')
  run_command(command, workspace / block_dir(block), workspace / 'cache')


def test_readme_commands_are_found():
  assert any(name.startswith('docs') for name, _ in BLOCKS), 'no docs page has a code block'
  commands = [c for block in BLOCKS.values() for c in block]
  assert 'python train.py --config=gpt_64k.py:smoke' in ' '.join(commands)
  assert any(c.startswith('JAX_NUM_CPU_DEVICES=8 ') for c in commands)
  heredoc = next(c for c in commands if c.startswith('cat > prompts.jsonl'))
  assert heredoc.endswith('\nEOF') and heredoc.count('\n') == 3, heredoc
