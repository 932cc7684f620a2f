"""Per-step metrics: metrics.jsonl, TensorBoard events and a progress bar."""

import json
import os

import jax
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeRemainingColumn)

from training.config import MetricsConfig

# Dense bf16 peak FLOP/s per device, by a substring of `device.device_kind`.
PEAK_FLOPS = {
    'H200': 989e12, 'H100': 989e12, 'H800': 989e12, 'GH200': 989e12, 'B200': 2250e12,
    'A100': 312e12, 'L40S': 362e12, 'L4': 121e12, 'A10G': 125e12,
    'TPU v6': 918e12, 'TPU v5p': 459e12, 'TPU v5 lite': 197e12, 'TPU v5e': 197e12,
    'TPU v4': 275e12,
}


def peak_flops_per_device(cfg: MetricsConfig, device=None) -> float | None:
  """Dense bf16 peak of one device; None when the device kind is not in PEAK_FLOPS."""
  if cfg.peak_tflops_per_device > 0:
    return cfg.peak_tflops_per_device * 1e12
  kind = (device or jax.devices()[0]).device_kind.lower()
  # Longest name first: 'L40S' must not be read as 'L4'.
  for name in sorted(PEAK_FLOPS, key=len, reverse=True):
    if name.lower() in kind:
      return PEAK_FLOPS[name]
  return None


def mfu_note(cfg: MetricsConfig, device=None) -> str:
  """What the start-up line says about MFU: '' when it is reported."""
  if peak_flops_per_device(cfg, device) is not None:
    return ''
  kind = (device or jax.devices()[0]).device_kind
  return (f'MFU not reported: peak FLOP/s of a {kind!r} device unknown (set '
          '--config.metrics.peak_tflops_per_device)')


class MetricsLogger:
  """Appends one JSON object per step and mirrors it to TensorBoard and the console."""

  def __init__(self, workdir: str, cfg: MetricsConfig, *, start_step: int, total_steps: int,
               enabled: bool = True):
    self._enabled = enabled
    self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a') if enabled else None
    self._tb = None
    if enabled and cfg.tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))
    self._progress = None
    if enabled and cfg.progress_bar:
      self._progress = Progress(
          TextColumn('[bold]train'), BarColumn(), MofNCompleteColumn(),
          TextColumn('{task.fields[info]}'), TimeRemainingColumn())
      self._progress.start()
      self._task = self._progress.add_task('train', total=total_steps, completed=start_step,
                                           info='')

  def log(self, record: dict) -> None:
    if not self._enabled:
      return
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()
    step = record['step']
    if self._tb is not None:
      for key, value in record.items():
        if key != 'step' and isinstance(value, (int, float)):
          tag = f'eval/{key[len("eval_"):]}' if key.startswith('eval_') else f'train/{key}'
          self._tb.add_scalar(tag, value, step)
    if self._progress is not None:
      info = f"loss {record['loss']:.4f}  {record['tokens_per_sec']:,.0f} tok/s"
      self._progress.update(self._task, completed=step, info=info)

  def close(self) -> None:
    if self._progress is not None:
      self._progress.stop()
    if self._tb is not None:
      self._tb.close()
    if self._jsonl is not None:
      self._jsonl.close()
