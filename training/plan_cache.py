"""The mesh planner's numbers kept between runs: one JSON file per compiled layout
holding what training/plan.py's compile_layout measured (planner.Measured), so a second
`python -m training.plan_cli` over the same config reads what the first compiled.

A measurement is a function of the program compiled and the compiler alone: the config
with the layout applied (every field, the layer count of an extrapolation's compile
too), the source of the packages the step is built and read from (model, sharding,
training, pallas_kernels: any edit there is a new key), the versions of jax, jaxlib,
flax and optax, XLA_FLAGS, the backend and its device count. The key hashes all of
them, so an entry is only read back for the same program compiled the same way. This
keeps the numbers, not jax's compiled programs: jax's persistent cache would still pay
for tracing and lowering each step, and nothing is read from a deserialized executable.

An entry that cannot be read is compiled again and rewritten; the directory has no size
limit (a few kB an entry): delete it to reclaim the space.
"""

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib

import jax

from sharding import planner
from training import config as config_lib

DEFAULT_DIR = '~/.cache/meshlm/plan'
PACKAGES = ('model', 'sharding', 'training', 'pallas_kernels')
_LIBRARIES = ('jax', 'jaxlib', 'flax', 'optax')


class MeasureCache:
  """get/put planner.Measured by the config (layout applied) it was compiled from."""

  def __init__(self, directory: str):
    self.directory = pathlib.Path(directory).expanduser()
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise ValueError(f'--cache-dir {directory}: cannot create it ({e.strerror}); give a '
                       "writable directory, or 'none' to compile every layout.") from None

  def key(self, cfg: config_lib.Config) -> str:
    """cfg: the config with the layout (and an extrapolation's layer count) applied."""
    blob = json.dumps({'config': dataclasses.asdict(cfg), 'environment': environment()},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()

  def get(self, cfg: config_lib.Config) -> planner.Measured | None:
    path = self.directory / f'{self.key(cfg)}.json'
    try:
      return from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
      return None   # missing or unreadable: compiled again

  def put(self, cfg: config_lib.Config, measured: planner.Measured) -> None:
    path = self.directory / f'{self.key(cfg)}.json'
    tmp = path.with_suffix(f'.{os.getpid()}.tmp')
    tmp.write_text(json.dumps(to_json(measured)))
    os.replace(tmp, path)   # readers see a whole entry or none


def environment() -> dict:
  """What else decides a compile's numbers, besides the config (module docstring)."""
  return {'source': source_digest(), 'libraries': _versions(),
          'xla_flags': os.environ.get('XLA_FLAGS', ''), 'backend': jax.default_backend(),
          'devices': jax.device_count()}


@functools.cache
def source_digest() -> str:
  root = pathlib.Path(__file__).resolve().parent.parent
  digest = hashlib.sha256()
  for package in PACKAGES:
    for path in sorted((root / package).rglob('*.py')):
      digest.update(str(path.relative_to(root)).encode())
      digest.update(path.read_bytes())
  return digest.hexdigest()


@functools.cache
def _versions() -> dict:
  out = {}
  for name in _LIBRARIES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = 'absent'
  return out


def to_json(m: planner.Measured) -> dict:
  out = dataclasses.asdict(m)
  out['collectives'] = {k: list(v) for k, v in m.collectives.items()}
  out['by_axes'] = [[kind, list(axes), count, nbytes]
                    for (kind, axes), (count, nbytes) in m.by_axes.items()]
  return out


def from_json(d: dict) -> planner.Measured:
  d = dict(d)
  d['collectives'] = {k: tuple(v) for k, v in d['collectives'].items()}
  d['by_axes'] = {(kind, tuple(axes)): (count, nbytes)
                  for kind, axes, count, nbytes in d['by_axes']}
  return planner.Measured(**d)
