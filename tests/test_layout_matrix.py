"""Every layout validate accepts trains like one device, in one process and in two.

The matrix (tests/layout_matrix.py) is sampled with a fixed seed to keep the suite's
time; `pytest tests/test_layout_matrix.py --layout-matrix=all` runs every combination
(hours on 2 cores), `--layout-matrix=N` a sample of N. Each test prints the measured
errors beside the tolerance.
"""

import collections
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import layout_matrix as lm

ROOT = pathlib.Path(__file__).parent.parent
IN_PROCESS, TWO_PROCESSES = 10, 4   # sampled combinations per run


def _matrix():
  return lm.classify(lm.all_combos())


def _sample_size(config, default: int) -> int | None:
  value = config.getoption('--layout-matrix')
  return None if value == 'all' else int(value) if value else default


def pytest_generate_tests(metafunc):
  if 'combo' in metafunc.fixturenames:
    accepted, _ = _matrix()
    combos = lm.sample(accepted, _sample_size(metafunc.config, IN_PROCESS), seed=0)
    metafunc.parametrize('combo', combos, ids=[c.name for c in combos])


_REFERENCES = {}


def reference_of(combo: lm.Combo):
  import jax  # pylint: disable=import-outside-toplevel
  ref = lm.reference(combo)
  if ref not in _REFERENCES:
    _REFERENCES[ref] = lm.loss_and_grads(lm.config(ref), jax.devices()[:1])
  return _REFERENCES[ref]


def check(name: str, got, want) -> None:
  loss_err, grad_err = lm.errors(got, want)
  print(f'{name}: loss rel err {loss_err:.1e}, worst grad rel err {grad_err:.1e} '
        f'(tolerance {lm.TOLERANCE:.0e})')
  assert loss_err < lm.TOLERANCE and grad_err < lm.TOLERANCE, (name, loss_err, grad_err)


def test_refused_combinations_are_listed_with_reasons():
  accepted, refused = _matrix()
  reasons = collections.Counter(why.split(':')[0] for _, why in refused)
  print(f'{len(accepted)} combinations run, {len(refused)} refused:')
  for why, count in reasons.most_common():
    print(f'  {count:5d}  {why}')
  assert accepted and refused
  # every refusal names a field to change
  fields = ('mesh.', 'parallel.', 'model.', 'data.', 'optim.')
  assert all(any(f in why for f in fields) for _, why in refused)


def test_layout_equals_one_device(combo):
  check(combo.name, lm.loss_and_grads(lm.config(combo)), reference_of(combo))


# LoRA adapters on a frozen base (lm.lora_config): their gradients on DP, ZeRO-3, TP and
# mixes with the pipeline, the ring, experts and accumulation.
LORA_LAYOUTS = [
    lm.Combo((8, 1, 1, 1, 1, 1), zero=0, lora=True),
    lm.Combo((1, 1, 8, 1, 1, 1), zero=3, lora=True),
    lm.Combo((2, 1, 1, 1, 1, 4), zero=0, lora=True),
    lm.Combo((2, 1, 2, 1, 1, 2), zero=3, accum=2, lora=True),
    lm.Combo((4, 1, 1, 1, 1, 2), zero=1, accum=2, lora=True),
    lm.Combo((4, 2, 1, 1, 1, 1), zero=1, lora=True),
    lm.Combo((2, 1, 2, 1, 2, 1), zero=2, context_strategy='ring', lora=True),
    lm.Combo((1, 1, 2, 2, 1, 2), zero=3, moe='dropless', lora=True),
]


@pytest.mark.parametrize('lora_combo', LORA_LAYOUTS, ids=[c.name for c in LORA_LAYOUTS])
def test_lora_layout_equals_one_device(lora_combo):
  combo = lora_combo
  lm.classify([combo])[0] or pytest.fail(f'validate refuses {combo.name}')
  check(combo.name, lm.loss_and_grads(lm.config(combo)), reference_of(combo))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def run_processes(combos, out, processes=2, devices=4):
  """Runs tests/layout_matrix.py's worker in `processes` processes of `devices` CPU
  devices each; returns their exit codes and outputs. Outputs go to files (a full pipe
  would stall a process inside a collective) and one process failing stops them all."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': f'{os.environ.get("XLA_FLAGS", "")} '
                      f'--xla_force_host_platform_device_count={devices}'}
  args = [sys.executable, '-m', 'tests.layout_matrix', '--out', str(out),
          '--combos', json.dumps([c.to_json() for c in combos]),
          f'--coordinator=127.0.0.1:{free_port()}', f'--num-processes={processes}']
  logs = [open(f'{out}.{i}.log', 'w+') for i in range(processes)]
  procs = [subprocess.Popen([*args, f'--process-id={i}'], cwd=ROOT, env=env, text=True,
                            stdout=logs[i], stderr=subprocess.STDOUT)
           for i in range(processes)]
  try:
    deadline = time.monotonic() + 900
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  outputs = []
  for log in logs:
    log.seek(0)
    outputs.append(log.read())
    log.close()
  return [p.returncode for p in procs], outputs


def test_layouts_across_two_processes_equal_one_device(request, tmp_path):
  """2 processes x 4 devices, half the sample with mesh.data=1, where a model axis or
  the fsdp/expert split spans the processes and each process loads rows of its own."""
  accepted, _ = _matrix()
  combos = lm.sample(accepted, _sample_size(request.config, TWO_PROCESSES), seed=1,
                     prefer=lambda c: c.sizes['data'] == 1)
  check_processes(combos, tmp_path / 'out.npz', 2, 4)


def check_processes(combos, out, processes: int, devices: int) -> None:
  codes, outputs = run_processes(combos, out, processes, devices)
  assert codes == [0] * processes, ''.join(o[-3000:] for o in outputs)
  got = np.load(out)
  for i, combo in enumerate(combos):
    grads = [got[f'{i}_grad{j}'] for j in range(len(reference_of(combo)[1]))]
    check(f'{processes} processes: {combo.name}', (float(got[f'{i}_loss']), grads),
          reference_of(combo))


def test_rows_that_are_neither_a_share_nor_all_across_four_processes(tmp_path):
  """4 processes x 2 devices, mesh.data=2 x context=4: processes 0 and 1 hold rows
  [0, 4), 2 and 3 rows [4, 8) (neither the even quarter nor the whole batch)."""
  check_processes([lm.Combo((2, 1, 1, 1, 4, 1), context_strategy='ring')],
                  tmp_path / 'out.npz', 4, 2)


# The layouts configs/gpt_64k.py and configs/gpt_moe.py run, on 8 devices, in bfloat16.
BF16_LAYOUTS = {
    'gpt_64k': lm.Combo((1, 1, 2, 1, 4, 1), zero=3, context_strategy='ring'),
    'gpt_moe': lm.Combo((1, 1, 1, 8, 1, 1), zero=3, moe='capacity'),
}
SEEDS = (0, 1, 2, 3)


@pytest.mark.parametrize('name', BF16_LAYOUTS)
def test_bfloat16_layout_is_as_close_to_float32_as_one_device(name):
  """In bfloat16 a mesh rounds in other places than one device, so it cannot equal it
  bit for bit; it must be as close to the float32 result as one device's bfloat16 is.

  Gradients: within twice one device's worst bf16 error against float32 over four
  batches (measured about 1e-2 for both). The loss: within one bfloat16 rounding (2^-8,
  relative). One device's own loss error is far smaller (7e-6 at gpt_64k's layout), and
  context parallelism's measured 4.6e-5 is not a sign of a fault: its attention keeps the
  probabilities in float32 where one device rounds them to bfloat16 before the value
  product, so their roundings differ, and the mean over 128 tokens cancels them unevenly.
  A fault that moves the loss moves the gradients too, and those are held to 2x."""
  import jax  # pylint: disable=import-outside-toplevel
  combo = BF16_LAYOUTS[name]
  one = jax.devices()[:1]
  f32 = lm.losses_and_grads(lm.config(lm.reference(combo)), one, SEEDS)
  one_bf16 = lm.losses_and_grads(lm.config(lm.reference(combo), 'bfloat16'), one, SEEDS)
  mesh_bf16 = lm.losses_and_grads(lm.config(combo, 'bfloat16'), None, SEEDS)
  one_err = np.max([lm.errors(b, f) for b, f in zip(one_bf16, f32)], axis=0)
  mesh_err = np.max([lm.errors(b, f) for b, f in zip(mesh_bf16, f32)], axis=0)
  bound = (2.0 ** -8, 2 * one_err[1])
  print(f'{name} bf16 vs float32, worst of {len(SEEDS)} batches: one device loss '
        f'{one_err[0]:.1e} grads {one_err[1]:.1e}; {combo.name} loss {mesh_err[0]:.1e} '
        f'grads {mesh_err[1]:.1e} (bounds: loss {bound[0]:.1e}, grads {bound[1]:.1e})')
  assert mesh_err[0] <= bound[0] and mesh_err[1] <= bound[1], (mesh_err, one_err)
