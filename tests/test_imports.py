"""The packages' import graph, read from the source with ast (nothing is imported): it
has no circle, and it points the way docs/architecture.md says (train.py, serve/ and
notebooks/ on top; sharding/ and pallas_kernels/ at the bottom).

Every import counts, a function's deferred one too: a deferred import hides a circle from
the interpreter, not from the reader.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ('model', 'sharding', 'serve', 'training', 'pallas_kernels')


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  parts = list(path.relative_to(root).with_suffix('').parts)
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  return {module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob('*.py')}


def _imported(name: str, path: pathlib.Path, node: ast.AST) -> list[str]:
  """The modules one import statement names: `from a import b` names a.b where a/b is a
  module, else a (its __init__)."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  base = node.module or ''
  if node.level:
    package = name.split('.')[:None if path.name == '__init__.py' else -1]
    package = package[:len(package) - node.level + 1]
    base = '.'.join(package + ([base] if base else []))
  return [f'{base}.{a.name}' for a in node.names] + [base]


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
  """Module -> the modules of ours it imports, anywhere in its file."""
  mods = modules(root)
  graph = {}
  for name, path in mods.items():
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        named = _imported(name, path, node)
        if isinstance(node, ast.ImportFrom):   # b is a module, or a name in a's __init__
          subs = [m for m in named[:-1] if m in mods]
          named = subs + ([named[-1]] if len(subs) < len(named) - 1 else [])
        edges |= {m for m in named if m in mods and m != name}
    graph[name] = edges
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One circle of the graph as [a, b, ..., a], or None (depth-first, colours)."""
  state, path = {}, []

  def visit(node):
    state[node] = 'open'
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 'open':
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    state[node] = 'done'
    path.pop()
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def _package(module: str) -> str:
  return module.split('.')[0]


def test_the_graph_sees_imports_anywhere_in_a_file(tmp_path):
  for pkg in PACKAGES:
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / '__init__.py').write_text('')
  (tmp_path / 'serve' / 'api').mkdir()
  (tmp_path / 'serve' / 'api' / '__init__.py').write_text('')
  (tmp_path / 'serve' / 'api' / 'app.py').write_text(
      'from serve.api import routes\nfrom . import protocol\nimport model\n')
  (tmp_path / 'serve' / 'api' / 'routes.py').write_text(
      'def f():\n  from serve.api.app import create_app\n')
  (tmp_path / 'serve' / 'api' / 'protocol.py').write_text('X = 1\n')
  graph = import_graph(tmp_path)
  assert graph['serve.api.app'] == {'serve.api.routes', 'serve.api.protocol', 'model'}
  assert find_cycle(graph) == ['serve.api.app', 'serve.api.routes', 'serve.api.app']
  assert find_cycle({'a': {'b'}, 'b': set()}) is None


def test_no_import_circles():
  cycle = find_cycle(import_graph())
  assert cycle is None, (
      f'import circle: {" -> ".join(cycle)}. Move what both sides need into a module '
      'below them both, or pass it in.')


def test_lower_packages_never_import_upward():
  """sharding/ and pallas_kernels/ import no model/ training/ serve/; model/ imports no
  training/ serve/; training/ imports no serve/."""
  above = {'sharding': {'model', 'training', 'serve'},
           'pallas_kernels': {'model', 'training', 'serve'},
           'model': {'training', 'serve'}, 'training': {'serve'}}
  wrong = sorted((a, b) for a, targets in import_graph().items() for b in targets
                 if _package(b) in above.get(_package(a), ()))
  assert not wrong, f'imports against the layering of docs/architecture.md: {wrong}'
