"""The docs site builds in strict mode, and the README stays a front door.

The build (Sphinx + MyST, docs/conf.py) turns every warning into an error: a link to a
missing page or heading, a page outside the table of contents, a reference page that
cannot be generated from the code. The README's links are checked here, since Sphinx does
not read it.
"""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
MAX_README_WORDS = 1500


def readme() -> str:
  with open(README, encoding='utf-8') as f:
    return f.read()


def test_docs_build_strict(tmp_path):
  result = subprocess.run(
      [sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-n', '-q', '-b', 'html',
       '-d', str(tmp_path / 'doctrees'), os.path.join(ROOT, 'docs'), str(tmp_path / 'html')],
      capture_output=True, text=True, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  page = (tmp_path / 'html' / 'reference' / 'config.html').read_text(encoding='utf-8')
  assert 'model.num_kv_heads' in page and 'mesh.context' in page, 'config reference empty'
  flags = (tmp_path / 'html' / 'reference' / 'serve-flags.html').read_text(encoding='utf-8')
  assert '--max-num-seqs' in flags and '--tool-call-parser' in flags, 'flag reference empty'
  models = (tmp_path / 'html' / 'models.html').read_text(encoding='utf-8')
  assert 'Qwen3ForCausalLM' in models and 'model.qk_norm=True' in models, 'no architectures'


def test_readme_is_short():
  words = len(readme().split())
  assert words <= MAX_README_WORDS, (
      f'README.md has {words} words (at most {MAX_README_WORDS}): move detail into docs/.')


def readme_links() -> list[str]:
  return [link for link in re.findall(r'\]\(([^)\s]+)\)', readme())
          if not re.match(r'\w+://', link)]


def test_readme_links_exist():
  missing = [link for link in readme_links()
             if not os.path.exists(os.path.join(ROOT, link.partition('#')[0]))]
  assert not missing, f'README.md links to files that do not exist: {missing}'


def test_readme_results_link_dated_result_files():
  table = readme().partition('## Results')[2]
  rows = [line for line in table.splitlines() if line.startswith('| ') and '---' not in line]
  assert len(rows) > 5, 'the README has no results table'
  for row in rows[1:]:
    files = re.findall(r'\]\((benchmarks/results/[^)]+\.json)\)', row)
    assert files, f'results row without its result file: {row}'
    with open(os.path.join(ROOT, files[0]), encoding='utf-8') as f:
      date = json.load(f).get('environment', {}).get('date', '')
    assert date[:10] in row, f'{files[0]} is dated {date[:10]!r}; its row says: {row}'


def test_readme_feature_rows_link_docs():
  table = readme().partition('## Features')[2].partition('\n## ')[0]
  rows = [line for line in table.splitlines() if line.startswith('| ') and '---' not in line]
  assert len(rows) > 5, 'the README has no feature table'
  for row in rows[1:]:
    assert re.search(r'\]\(docs/[^)]+\.md', row), f'feature row without a docs link: {row}'
