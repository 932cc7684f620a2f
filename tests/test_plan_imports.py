"""The import direction DESIGN.md draws: sharding/ imports nothing of ours but itself and
pallas_kernels/ names, so the planner's search and CLI, which build train steps, live in
training/ (training/plan.py, training/plan_cli.py) and sharding/planner.py keeps only
the cost model."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
ABOVE_SHARDING = ('training', 'serve', 'model', 'train', 'notebooks', 'benchmarks')


def imported_packages(path: pathlib.Path) -> set[str]:
  """The top-level package of every import in the file, at any depth (inside functions
  too: a deferred import is still a dependency)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out |= {alias.name.split('.')[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      out.add(node.module.split('.')[0])
  return out


def test_sharding_imports_nothing_above_it():
  wrong = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & set(ABOVE_SHARDING))
           for p in sorted((ROOT / 'sharding').rglob('*.py'))}
  wrong = {k: v for k, v in wrong.items() if v}
  assert not wrong, f'sharding/ imports packages above it: {wrong}'
