"""notebooks/ run top to bottom (nbclient on an ipykernel), so they cannot rot; they are
kept without outputs in git."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(ROOT, 'notebooks')) if f.endswith('.ipynb'))


@pytest.mark.parametrize('name', NOTEBOOKS)
def test_notebook_runs_and_is_stored_without_outputs(name, monkeypatch):
  path = os.path.join(ROOT, 'notebooks', name)
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == 'code']
  assert code and not any(c.outputs or c.execution_count for c in code), \
      f'{name} is stored with outputs: clear them before committing'
  # the kernel imports this checkout (restored after the test: the next test's
  # subprocesses must not inherit it)
  monkeypatch.setenv('PYTHONPATH', os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  NotebookClient(nb, timeout=600, kernel_name='python3',
                 resources={'metadata': {'path': ROOT}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == 'code' for o in c.outputs]
  assert not [o for o in outputs if o.output_type == 'error']
  text = ''.join(o.get('text', '') for o in outputs)
  assert 'GiB/dev' in text and "['layers']['wq']" in text and 'per device' in text, text[-2000:]
