"""`train.py --help` says of each mesh axis only what validate agrees with.

The help text is the config dataclasses' field docstrings; a docstring left behind when a
feature lands ("not built yet: must be 1") would tell users a working axis is refused.
"""

import dataclasses
import re

import pytest

from sharding.mesh import MESH_AXES
from training import config as config_lib
from training import describe

# What validate needs beside an axis of 2 for that axis to have work to split.
NEEDS = {'expert': {'num_experts': 2}}
REFUSES = re.compile(r'must be 1|not built|not yet|unsupported|not supported', re.I)


def help_lines(cfg: config_lib.Config) -> dict[str, str]:
  """{'section.field': its help line} from the text `train.py --help` prints."""
  lines, section = {}, None
  for line in describe.help_text(cfg, 'default.py', ()).splitlines():
    header = re.match(r'(\w[\w ]*): ', line)
    if header:
      section = header.group(1)
    elif section and line.startswith('  ') and line.split():
      lines[f'{section}.{line.split()[0]}'] = line
  return lines


def config_with(axis: str, size: int) -> config_lib.Config:
  cfg = config_lib.Config()
  cfg.mesh = dataclasses.replace(cfg.mesh, **{'data': 1, axis: size})
  cfg.model = dataclasses.replace(cfg.model, **NEEDS.get(axis, {}))
  return cfg


@pytest.mark.parametrize('axis', MESH_AXES)
def test_mesh_axis_help_agrees_with_validate(axis):
  config_lib.validate(config_with(axis, 2), num_devices=2)   # raises if refused
  line = help_lines(config_lib.Config())[f'mesh.{axis}']
  assert not REFUSES.search(line), (
      f'validate accepts mesh.{axis}=2, but --help says: {line.strip()}')


def test_no_help_line_says_a_feature_is_missing():
  stale = [line.strip() for line in help_lines(config_lib.Config()).values()
           if re.search(r'not built|not yet', line, re.I)]
  assert not stale, stale
