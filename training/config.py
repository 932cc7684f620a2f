"""The run configuration: typed dataclasses, one per section.

`configs/*.py` files build a `Config` in `get_config(variant)`; `train.py` loads one with
ml_collections' `config_flags`, which type-checks every `--config.a.b=value` override.
"""

import dataclasses
import glob
import json
import os

import jax

from model.config import ModelConfig
from sharding.mesh import MeshConfig, mesh_shape


@dataclasses.dataclass
class ParallelConfig:
  zero_stage: int = 0              # 0 DP, 1 opt state sharded, 2 + grads, 3 + params (FSDP)
  sequence_parallel: bool = True   # with tensor > 1: residual stream sharded on seq


@dataclasses.dataclass
class DataConfig:
  train_files: str = ''     # comma-separated globs of token files ('' = default corpus)
  tokenizer: str = 'byte'   # 'byte' or a path to a HF tokenizer.json
  batch_size: int = 16      # global sequences per step
  seq_len: int = 128
  pack_documents: bool = True   # segment ids + positions restart at document boundaries
  shuffle: bool = True
  worker_count: int = 0     # grain worker processes (0: in the main process)
  cache_dir: str = '~/.cache/meshlm'   # where the default corpus is built once
  corpus_max_mb: int = 8    # size cap of the default corpus


@dataclasses.dataclass
class OptimConfig:
  learning_rate: float = 3e-3
  min_lr_ratio: float = 0.1   # cosine decays to learning_rate * min_lr_ratio
  warmup_steps: int = 20
  decay_steps: int = 0        # 0: decay over the run's `steps`
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip: float = 1.0      # global-norm clipping; 0 disables
  grad_accum: int = 1         # microbatches per step


@dataclasses.dataclass
class CheckpointConfig:
  every_steps: int = 100
  keep: int = 3
  async_save: bool = True


@dataclasses.dataclass
class MetricsConfig:
  log_every: int = 1
  peak_tflops_per_device: float = 0.0   # 0: from the device kind (unknown: no MFU)
  tensorboard: bool = True
  progress_bar: bool = True


@dataclasses.dataclass
class SampleConfig:
  prompt: str = 'def '
  num_tokens: int = 0        # tokens generated after training (0: no sample)
  temperature: float = 0.8


@dataclasses.dataclass
class DistributedConfig:
  """Multi-process runs: one process per host (or per GPU), joined before any device use."""
  coordinator: str = ''     # '' single process; 'auto' (SLURM, Open MPI, ...); or HOST:PORT
  num_processes: int = 1    # with HOST:PORT
  process_id: int = 0       # with HOST:PORT


@dataclasses.dataclass
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
  sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  steps: int = 200
  workdir: str = 'runs/default'
  seed: int = 0


def init_distributed(cfg: DistributedConfig) -> None:
  """Joins the processes of a multi-process run; must precede any use of devices."""
  if not cfg.coordinator:
    return
  # CPU processes exchange collectives through gloo (the default CPU backend has none).
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if cfg.coordinator == 'auto':
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(coordinator_address=cfg.coordinator,
                               num_processes=cfg.num_processes, process_id=cfg.process_id)


def validate(cfg: Config, num_devices: int, process_count: int = 1) -> None:
  """Checks what can be checked before touching a device; errors name field and fix."""
  cfg.model.validate()
  sizes = mesh_shape(cfg.mesh, num_devices)
  if cfg.parallel.zero_stage not in (0, 1, 2, 3):
    raise ValueError(f'parallel.zero_stage={cfg.parallel.zero_stage}: choose 0, 1, 2 or 3.')
  if cfg.parallel.zero_stage and sizes['fsdp'] == 1:
    raise ValueError(
        f'parallel.zero_stage={cfg.parallel.zero_stage} shards over the fsdp mesh axis, but '
        'mesh.fsdp=1: set e.g. --config.mesh.fsdp=-1 --config.mesh.data=1.')
  seq_shards = sizes['context'] * (sizes['tensor'] if cfg.parallel.sequence_parallel else 1)
  if cfg.data.seq_len % seq_shards:
    raise ValueError(
        f'data.seq_len={cfg.data.seq_len} does not split over the {seq_shards} sequence '
        'shards (mesh.context x mesh.tensor with parallel.sequence_parallel): choose a '
        f'multiple of {seq_shards}.')
  if cfg.steps < 0:
    raise ValueError(f'steps={cfg.steps} must be >= 0.')
  for name in ('num_heads', 'num_kv_heads'):
    if getattr(cfg.model, name) % sizes['tensor']:
      raise ValueError(f'model.{name}={getattr(cfg.model, name)} is not divisible by '
                       f'mesh.tensor={sizes["tensor"]}: pick a tensor size that divides it.')
  for name in ('stage', 'expert', 'context'):
    if sizes[name] != 1:
      raise ValueError(f'mesh.{name}={sizes[name]}: {name} parallelism is not available yet; '
                       f'set --config.mesh.{name}=1.')
  batch_shards = sizes['data'] * sizes['fsdp']
  micro = cfg.data.batch_size // max(cfg.optim.grad_accum, 1)
  if cfg.optim.grad_accum < 1 or cfg.data.batch_size % cfg.optim.grad_accum:
    raise ValueError(f'data.batch_size={cfg.data.batch_size} must be a multiple of '
                     f'optim.grad_accum={cfg.optim.grad_accum} (>= 1).')
  if micro % batch_shards:
    raise ValueError(
        f'each microbatch has {micro} sequences (data.batch_size / optim.grad_accum), '
        f'not divisible by mesh.data * mesh.fsdp = {batch_shards}: change data.batch_size.')
  if cfg.data.batch_size % process_count:
    raise ValueError(f'data.batch_size={cfg.data.batch_size} is not divisible by the '
                     f'{process_count} processes.')
  if cfg.data.seq_len > cfg.model.max_seq_len:
    raise ValueError(f'data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len='
                     f'{cfg.model.max_seq_len}: raise model.max_seq_len.')
  if not 0 <= cfg.sample.num_tokens < cfg.model.max_seq_len:
    raise ValueError(f'sample.num_tokens={cfg.sample.num_tokens} must be in [0, '
                     f'model.max_seq_len={cfg.model.max_seq_len}).')
  if cfg.checkpoint.every_steps < 1 or cfg.checkpoint.keep < 1:
    raise ValueError('checkpoint.every_steps and checkpoint.keep must be >= 1.')


def data_files(cfg: DataConfig) -> list[str]:
  """Expands `train_files` globs; a pattern matching nothing is an error."""
  files = []
  for pattern in filter(None, (p.strip() for p in cfg.train_files.split(','))):
    found = sorted(glob.glob(os.path.expanduser(pattern)))
    if not found:
      raise FileNotFoundError(
          f'data.train_files: no token file matches {pattern!r}. Create one with '
          '`python -m training.prepare --input TEXT_FILES --output OUT.bin`, or leave '
          'data.train_files empty to use the default corpus.')
    files.extend(found)
  return files


def to_json(cfg: Config) -> str:
  return json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True)
