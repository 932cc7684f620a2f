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
from model.lora import LoraConfig
from sharding import compile_cache, offload
from sharding.mesh import MeshConfig, mesh_shape


@dataclasses.dataclass
class ParallelConfig:
  """How the mesh is used beyond the rules table."""
  zero_stage: int = 0
  """0 DP; 1 optimizer state sharded over fsdp; 2 + gradients; 3 + parameters (FSDP)."""
  sequence_parallel: bool = True
  """With mesh.tensor > 1: the residual stream between blocks is split on the sequence."""
  offload_optimizer: bool = False
  """Keep the optimizer state in host memory (pinned_host) between steps, in its ZeRO
  layout, and move it to the device for the update (ZeRO-Offload)."""
  context_strategy: str = 'all_gather'
  """With mesh.context > 1: 'all_gather' (keys and values gathered whole, queries split)
  or 'ring' (K/V chunks passed round the devices by collective permutes, partial results
  merged by log-sum-exp; no device holds more than two chunks)."""
  context_load_balance: bool = True
  """With mesh.context > 1: reorder each sequence once at the input so device i holds
  chunks i and 2N-1-i of 2N, giving every device the same causal attention work."""
  microbatches: int = 0
  """With mesh.stage > 1: microbatches each (grad_accum) batch is cut into for the
  pipeline; 0: mesh.stage. The bubble is (stages - 1) / (microbatches * repeats +
  stages - 1) of the layer work."""
  pipeline_repeats: int = 1
  """With mesh.stage > 1: circular repeats (virtual stages): each stage holds this many
  non-adjacent chunks of layers and each microbatch goes round the stages this many
  times, shrinking the bubble; needs microbatches >= mesh.stage when > 1."""


@dataclasses.dataclass
class DataConfig:
  """Token files, tokenizer and batch shape."""
  train_files: str = ''
  """Comma-separated globs of token files ('' = the default corpus)."""
  tokenizer: str = 'byte'
  """'byte', or a path to a Hugging Face tokenizer.json."""
  batch_size: int = 16
  """Global sequences per step (all processes, all microbatches)."""
  seq_len: int = 128
  """Tokens per training sequence."""
  pack_documents: bool = True
  """Segment ids and positions restart at document boundaries."""
  shuffle: bool = True
  """Shuffle the windows by seed (a new order each epoch)."""
  worker_count: int = 0
  """Grain worker processes (0: read in the main process)."""
  cache_dir: str = '~/.cache/meshlm'
  """Where the default corpus is built once."""
  corpus_max_mb: int = 8
  """Size cap of the default corpus, in MB of source text."""
  source: str = ''
  """'': token files; else 'package.module:function', (seed, index, batch_size) -> batch
  `index` as a dict of numpy arrays with a leading batch axis (synthetic or in-memory data
  for a model.module; batch['weights'] weighs each example)."""


@dataclasses.dataclass
class OptimConfig:
  """AdamW with warmup and cosine decay."""
  learning_rate: float = 3e-3
  """Peak learning rate."""
  min_lr_ratio: float = 0.1
  """The cosine decays to learning_rate * min_lr_ratio."""
  warmup_steps: int = 20
  """Linear warmup from 0."""
  decay_steps: int = 0
  """Length of the schedule; 0: the run's `steps` (set it to keep the schedule fixed)."""
  b1: float = 0.9
  """Adam beta1."""
  b2: float = 0.95
  """Adam beta2."""
  eps: float = 1e-8
  """Adam epsilon."""
  weight_decay: float = 0.1
  """Decoupled weight decay (not applied to norm scales)."""
  grad_clip: float = 1.0
  """Global-norm gradient clipping; 0 disables it."""
  grad_accum: int = 1
  """Microbatches per step (their gradients summed before one update)."""
  max_skipped_steps: int = 5
  """A step with a non-finite loss or gradient changes nothing and is skipped; this many
  in a row stop the run (exit status 3)."""


@dataclasses.dataclass
class CheckpointConfig:
  """Orbax checkpoints under workdir/checkpoints."""
  every_steps: int = 100
  """Save every this many steps (and always at the last step)."""
  keep: int = 3
  """Checkpoints kept; older ones are pruned."""
  async_save: bool = True
  """Write in the background while training continues."""
  on_save_error: str = 'continue'
  """A save that fails (disk full, unwritable): 'continue' reports it and trains on (the
  next save tries again); 'stop' ends the run (exit status 4)."""


@dataclasses.dataclass
class EvalConfig:
  """The loss on held-out data, measured during training."""
  every_steps: int = 0
  """Evaluate every this many steps, and after the last (0: never)."""
  batches: int = 4
  """Batches of data.batch_size sequences per evaluation, the same ones every time."""
  files: str = ''
  """Comma-separated globs of held-out token files; '': the last eval.batches batches of
  windows of the training data, left out of training while evaluation is on."""


@dataclasses.dataclass
class MetricsConfig:
  """What each step reports."""
  log_every: int = 1
  """Write metrics every this many steps."""
  peak_tflops_per_device: float = 0.0
  """Peak TFLOP/s for MFU; 0: from the device kind (unknown kinds: no MFU)."""
  tensorboard: bool = True
  """Also write TensorBoard events under workdir/tensorboard."""
  progress_bar: bool = True
  """Show a progress bar with loss and tokens/s."""


@dataclasses.dataclass
class SampleConfig:
  """A short sample printed after training."""
  prompt: str = 'def '
  """Text the sample continues."""
  num_tokens: int = 0
  """Tokens generated after training (0: no sample)."""
  temperature: float = 0.8
  """Sampling temperature (0: greedy)."""


@dataclasses.dataclass
class DistributedConfig:
  """Multi-process runs: one process per host (or per GPU), joined before any device use."""
  coordinator: str = ''
  """'' single process; 'auto' (SLURM, Open MPI, ...); or HOST:PORT."""
  num_processes: int = 1
  """Processes in the run (with HOST:PORT)."""
  process_id: int = 0
  """This process's index (with HOST:PORT)."""


@dataclasses.dataclass
class Config:
  """A training run."""
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
  sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
  steps: int = 200
  """Training steps in all (a rerun with more resumes from the last checkpoint)."""
  workdir: str = 'runs/default'
  """Run directory: config.json, metrics.jsonl, events.jsonl, tensorboard/, checkpoints/."""
  seed: int = 0
  """Seed of the initial weights and the data order."""
  init_from_hf: str = ''
  """A local Hugging Face Llama directory whose weights start the run (fine-tuning): its
  architecture replaces model's shape fields and its tokenizer.json is data.tokenizer
  unless that names another (training/pretrained.py); read at every start, its weights
  only when workdir has no checkpoint to resume."""
  rules: dict = dataclasses.field(default_factory=dict)
  """With model.module: the module's own logical axis names -> a built-in one (sharded as
  it, ZeRO included: 'embed', 'mlp', 'heads', 'kv_heads', 'head_dim', 'vocab', 'experts',
  'layers') or mesh axes (e.g. 'tensor'; None replicates); built-in names need no entry."""
  compilation_cache_dir: str = compile_cache.DEFAULT_DIR
  """jax's persistent compilation cache: a rerun reads the compiled steps from here
  instead of compiling them again; 'none' turns it off (sharding/compile_cache.py)."""


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


def pipeline_microbatches(cfg: Config, stages: int) -> int:
  return cfg.parallel.microbatches or stages


def _validate_pipeline(cfg: Config, sizes) -> None:
  stages, repeats = sizes['stage'], cfg.parallel.pipeline_repeats
  if cfg.parallel.microbatches < 0 or repeats < 1:
    raise ValueError(f'parallel.microbatches={cfg.parallel.microbatches} and '
                     f'parallel.pipeline_repeats={repeats}: need >= 0 and >= 1.')
  if stages == 1:
    return
  micro = pipeline_microbatches(cfg, stages)
  if cfg.model.num_layers % (stages * repeats):
    raise ValueError(f'model.num_layers={cfg.model.num_layers} does not split into mesh.stage '
                     f'x parallel.pipeline_repeats = {stages * repeats} equal chunks: choose '
                     'sizes whose product divides it.')
  if repeats > 1 and micro < stages:
    raise ValueError(f'parallel.microbatches={micro} is below mesh.stage={stages}: circular '
                     'repeats need at least one microbatch per stage; raise it.')
  if cfg.model.num_experts or sizes['context'] > 1 or cfg.model.attention_impl != 'xla':
    raise ValueError(
        f'mesh.stage={stages} runs dense models with model.attention_impl=xla and '
        'mesh.context=1 (the pipeline does not run MoE layers, context parallelism or '
        'the attention kernels): change those, or set --config.mesh.stage=1.')
  shards = sizes['data'] * sizes['fsdp'] * sizes['expert']
  rows = cfg.data.batch_size // max(cfg.optim.grad_accum, 1)
  if rows % (micro * shards):
    raise ValueError(
        f'each grad_accum microbatch has {rows} sequences, not divisible by '
        f'parallel.microbatches ({micro}) x the batch shards ({shards}): change '
        'data.batch_size or parallel.microbatches.')


def _validate_context(cfg: Config, sizes) -> None:
  n = sizes['context']
  if n > 1 and cfg.model.sliding_window:
    raise ValueError(f'mesh.context={n} with model.sliding_window={cfg.model.sliding_window}: '
                     'context parallelism attends the whole context; set mesh.context=1.')
  if n > 1 and cfg.model.attn_softcap:
    raise ValueError(f'mesh.context={n} with model.attn_softcap={cfg.model.attn_softcap}: '
                     'context parallelism does not soft-cap attention; set mesh.context=1.')
  if cfg.parallel.context_strategy not in ('all_gather', 'ring'):
    raise ValueError(f'parallel.context_strategy={cfg.parallel.context_strategy!r}: choose '
                     "'all_gather' or 'ring'.")
  if n == 1:
    return
  ring = cfg.parallel.context_strategy == 'ring'
  if cfg.model.attention_impl not in (('xla', 'pallas') if ring else ('xla',)):
    raise ValueError(
        f'mesh.context={n} with parallel.context_strategy={cfg.parallel.context_strategy!r} '
        f'runs model.attention_impl=xla{" or pallas" if ring else ""}, not '
        f'{cfg.model.attention_impl!r}: set --config.model.attention_impl='
        f'{"pallas (the flash kernel in the ring)" if ring else "xla, or use the ring strategy with pallas"}.')
  if cfg.parallel.context_load_balance and cfg.data.seq_len % (2 * n):
    raise ValueError(
        f'data.seq_len={cfg.data.seq_len} does not split into 2 x mesh.context = {2 * n} '
        'chunks for parallel.context_load_balance: choose a multiple of '
        f'{2 * n} (or set --config.parallel.context_load_balance=False).')


def validate(cfg: Config, num_devices: int, platform: str | None = None) -> None:
  """Checks what can be checked before touching a device; errors name field and fix.

  An axis of size 1 is always valid: ZeRO over fsdp=1 shards nothing and runs as DP.
  `platform` (jax.default_backend()) also checks that the attention runs there.
  """
  sizes = mesh_shape(cfg.mesh, num_devices)
  if cfg.model.module:
    _validate_user_model(cfg, sizes)
    if cfg.lora.rank:
      raise ValueError(f'lora.rank={cfg.lora.rank}: LoRA adapts the built-in model\'s '
                       'projections; a model.module trains its own parameters (set '
                       'lora.rank=0, or put adapters in the module itself).')
  else:
    cfg.model.validate()
    if cfg.lora.rank:
      cfg.lora.validate(cfg.model)
    validate_lora_base(cfg)
  if cfg.parallel.zero_stage not in (0, 1, 2, 3):
    raise ValueError(f'parallel.zero_stage={cfg.parallel.zero_stage}: choose 0, 1, 2 or 3.')
  if platform not in (None, 'gpu') and cfg.model.attention_impl == 'cudnn':
    raise ValueError(
        f"model.attention_impl='cudnn' needs a GPU, and this run has {platform} devices: "
        "set --config.model.attention_impl=xla (or pallas), or size the run without "
        "running it with --check.")
  for on, field, value, fix in (
      (cfg.parallel.offload_optimizer, 'parallel.offload_optimizer', True,
       'set --config.parallel.offload_optimizer=False'),
      (cfg.model.remat == 'offload', 'model.remat', "'offload'",
       'set --config.model.remat=full (recompute instead of offloading)')):
    error = on and platform and offload.host_memory_error(field, value, fix,
                                                          jax.local_devices()[0])
    if error:
      raise ValueError(error)
  seq_shards = sizes['context'] * (sizes['tensor'] if cfg.parallel.sequence_parallel else 1)
  if cfg.data.seq_len % seq_shards:
    raise ValueError(
        f'data.seq_len={cfg.data.seq_len} does not split over the {seq_shards} sequence '
        'shards (mesh.context x mesh.tensor with parallel.sequence_parallel): choose a '
        f'multiple of {seq_shards}.')
  if cfg.steps < 0:
    raise ValueError(f'steps={cfg.steps} must be >= 0.')
  for name in ('num_heads', 'num_kv_heads') if not cfg.model.module else ():
    if getattr(cfg.model, name) % sizes['tensor']:
      raise ValueError(f'model.{name}={getattr(cfg.model, name)} is not divisible by '
                       f'mesh.tensor={sizes["tensor"]}: pick a tensor size that divides it.')
  _validate_context(cfg, sizes)
  _validate_pipeline(cfg, sizes)
  _validate_experts(cfg, sizes)
  batch_shards = sizes['data'] * sizes['fsdp'] * sizes['expert']
  micro = cfg.data.batch_size // max(cfg.optim.grad_accum, 1)
  if cfg.optim.grad_accum < 1 or cfg.data.batch_size % cfg.optim.grad_accum:
    raise ValueError(f'data.batch_size={cfg.data.batch_size} must be a multiple of '
                     f'optim.grad_accum={cfg.optim.grad_accum} (>= 1).')
  if micro % batch_shards:
    raise ValueError(
        f'each microbatch has {micro} sequences (data.batch_size / optim.grad_accum), '
        f'not divisible by mesh.data * mesh.fsdp * mesh.expert = {batch_shards}: change '
        'data.batch_size.')
  if cfg.data.seq_len > cfg.model.max_seq_len:
    raise ValueError(f'data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len='
                     f'{cfg.model.max_seq_len}: raise model.max_seq_len.')
  if not 0 <= cfg.sample.num_tokens < cfg.model.max_seq_len:
    raise ValueError(f'sample.num_tokens={cfg.sample.num_tokens} must be in [0, '
                     f'model.max_seq_len={cfg.model.max_seq_len}).')
  if cfg.checkpoint.every_steps < 1 or cfg.checkpoint.keep < 1:
    raise ValueError('checkpoint.every_steps and checkpoint.keep must be >= 1.')
  if cfg.checkpoint.on_save_error not in ('continue', 'stop'):
    raise ValueError(f'checkpoint.on_save_error={cfg.checkpoint.on_save_error!r}: choose '
                     "'continue' or 'stop'.")
  if cfg.optim.max_skipped_steps < 1:
    raise ValueError(f'optim.max_skipped_steps={cfg.optim.max_skipped_steps} must be >= 1.')
  if cfg.eval.every_steps < 0 or cfg.eval.batches < 1:
    raise ValueError(f'eval.every_steps={cfg.eval.every_steps} must be >= 0 (0: no '
                     f'evaluation) and eval.batches={cfg.eval.batches} >= 1.')


def validate_lora_base(cfg: Config) -> None:
  """Before init_from_hf is read: a LoRA run takes one base."""
  if cfg.lora.base_checkpoint and not cfg.lora.rank:
    raise ValueError(f'lora.base_checkpoint={cfg.lora.base_checkpoint!r} is the frozen base '
                     'of a LoRA run: set lora.rank > 0 too (a full-model run starts from '
                     'init_from_hf or its own workdir).')
  if cfg.lora.base_checkpoint and cfg.init_from_hf:
    raise ValueError(f'init_from_hf={cfg.init_from_hf!r} and lora.base_checkpoint='
                     f'{cfg.lora.base_checkpoint!r} both name the base: keep one.')


def _validate_user_model(cfg: Config, sizes: dict[str, int]) -> None:
  """A model.module trains on data, fsdp and tensor (and ZeRO over fsdp); the built-in
  model's other seams (pipeline stages, context-parallel attention, expert dispatch) and
  its sampler are its own."""
  if not cfg.model.loss:
    raise ValueError(f"model.module={cfg.model.module!r} needs model.loss: "
                     "'package.module:function' taking (module, batch).")
  others = {a: sizes[a] for a in ('stage', 'context', 'expert') if sizes[a] > 1}
  if others:
    raise ValueError(f'mesh {others} with model.module: a user model trains on mesh.data, '
                     'mesh.fsdp and mesh.tensor; set the others to 1.')
  user_remat = ('none', 'full', 'save_matmuls')   # training/user_model.py's REMAT_POLICIES
  if cfg.model.remat not in user_remat:
    raise ValueError(f'model.remat={cfg.model.remat!r} with model.module: choose one of '
                     f'{user_remat}.')
  if cfg.data.source and cfg.eval.every_steps:
    raise ValueError(f'eval.every_steps={cfg.eval.every_steps} with data.source: evaluation '
                     'reads token files; set --config.eval.every_steps=0.')


def _validate_experts(cfg: Config, sizes: dict[str, int]) -> None:
  """Expert parallelism splits the experts (and the batch) over mesh.expert."""
  experts, n = cfg.model.num_experts, sizes['expert']
  if n > 1 and not experts:
    raise ValueError(f'mesh.expert={n} needs a mixture-of-experts model: set '
                     'model.num_experts (a multiple of it) or --config.mesh.expert=1.')
  if experts % n:
    raise ValueError(f'model.num_experts={experts} is not divisible by mesh.expert={n}: '
                     'choose a multiple of it, or another mesh.expert.')


def data_files(cfg: DataConfig) -> list[str]:
  """Expands `train_files` globs; a pattern matching nothing is an error."""
  return expand_files(cfg.train_files, 'data.train_files',
                      'or leave data.train_files empty to use the default corpus.')


def eval_files(cfg: EvalConfig) -> list[str]:
  """Expands `eval.files` globs; a pattern matching nothing is an error."""
  return expand_files(cfg.files, 'eval.files', 'or leave eval.files empty to hold out the '
                      'end of the training data.')


def expand_files(patterns: str, field: str, alternative: str) -> list[str]:
  files = []
  for pattern in filter(None, (p.strip() for p in patterns.split(','))):
    found = sorted(glob.glob(os.path.expanduser(pattern)))
    if not found:
      raise FileNotFoundError(
          f'{field}: no token file matches {pattern!r}. Create one with '
          f'`python -m training.prepare --input TEXT_FILES --output OUT.bin`, {alternative}')
    files.extend(found)
  return files


def held_out_windows(cfg: Config) -> int:
  """Windows at the end of the training data kept for evaluation (0 unless evaluation is
  on without eval.files)."""
  if not cfg.eval.every_steps or cfg.eval.files:
    return 0
  return cfg.eval.batches * cfg.data.batch_size


def read_config_json(directory: str, expected: str) -> dict:
  """DIRECTORY/config.json; FileNotFoundError saying what is missing and what the
  directory should be (`expected`: which flag takes what)."""
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    what = 'does not exist' if not os.path.isdir(directory) else 'has no config.json'
    raise FileNotFoundError(f'{directory} {what}: {expected}')
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def to_json(cfg: Config) -> str:
  return json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True)
