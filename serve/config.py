"""Engine settings, and the command-line flags the batch CLI and the server share."""

import argparse
import dataclasses

from serve.spec.config import SpeculativeConfig, parse_speculative_config
from sharding import compile_cache

ATTENTION_CHOICES = ('auto', 'xla', 'pallas')
DTYPE_CHOICES = ('auto', 'float32', 'bfloat16', 'float16')
GENERATION_CONFIG_CHOICES = ('auto', 'none')
# vLLM's names (fp8 is fp8_e4m3), and int8; model.kv_quant.KV_CACHE_DTYPES.
KV_CACHE_DTYPE_CHOICES = ('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'int8')
QUANTIZATION_CHOICES = ('none', 'int8', 'fp8')


@dataclasses.dataclass
class ServeConfig:
  block_size: int = 16               # tokens per KV block
  num_blocks: int = 0                # 0: sized from memory_fraction
  memory_fraction: float = 0.9       # of the device memory left after the weights
  max_num_seqs: int = 64             # running requests at once
  max_num_batched_tokens: int = 512  # tokens per step (prefill chunks + decodes)
  max_model_len: int = 0             # 0: the model's max_seq_len
  attention: str = 'auto'            # 'auto': pallas on GPU, xla on CPU
  dtype: str = 'auto'                # weights, activations, KV cache; 'auto': the model's
  kv_cache_dtype: str = 'auto'       # KV pages: 'auto' (--dtype's), or 8-bit with scales
  quantization: str = 'none'         # 8-bit layer weights at load: int8 or fp8 (model/quant.py)
  tensor: int = 1                    # devices over the mesh's 'tensor' axis
  enable_prefix_caching: bool = True
  max_waiting_requests: int = 256    # beyond it add_request raises QueueFull
  seed: int = 0                      # draws the seeds of requests that give none
  warmup: bool = False               # compile every step shape at start, not on first use
  # auto: a request's missing sampling fields take the model's generation_config.json
  # values (temperature, top_p, top_k, min_p, repetition_penalty); none: OpenAI's defaults
  generation_config: str = 'auto'
  # vLLM's JSON, e.g. '{"method": "ngram", "num_speculative_tokens": 4}'; '': off
  speculative_config: str = ''
  # LoRA adapters (vLLM's flags): NAME=DIR PEFT directories loaded at start, how many
  # may be in one batch (device slots), the largest rank any may have, and how many may
  # be loaded in host memory (0: max_loras).
  enable_lora: bool = False
  lora_modules: tuple = ()
  max_loras: int = 1
  max_lora_rank: int = 16
  max_cpu_loras: int = 0

  def validate(self) -> None:
    """Raises ValueError naming the flag and the fix."""
    positive = ('block_size', 'max_num_seqs', 'max_num_batched_tokens', 'tensor',
                'max_waiting_requests')
    for name in positive:
      if getattr(self, name) < 1:
        raise ValueError(f'--{_flag(name)}={getattr(self, name)}: must be at least 1.')
    for name in ('num_blocks', 'max_model_len'):
      if getattr(self, name) < 0:
        raise ValueError(f'--{_flag(name)}={getattr(self, name)}: must be 0 (automatic) '
                         'or positive.')
    if not 0 < self.memory_fraction <= 1:
      raise ValueError(f'--memory-fraction={self.memory_fraction}: must be in (0, 1].')
    if self.attention not in ATTENTION_CHOICES:
      raise ValueError(f'--attention={self.attention!r}: choose one of {ATTENTION_CHOICES}.')
    if self.dtype not in DTYPE_CHOICES:
      raise ValueError(f'--dtype={self.dtype!r}: choose one of {DTYPE_CHOICES}.')
    if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
      raise ValueError(f'--kv-cache-dtype={self.kv_cache_dtype!r}: choose one of '
                       f'{KV_CACHE_DTYPE_CHOICES}.')
    if self.quantization not in QUANTIZATION_CHOICES:
      raise ValueError(f'--quantization={self.quantization!r}: choose one of '
                       f'{QUANTIZATION_CHOICES} (weight-only, per-channel scales).')
    if self.generation_config not in GENERATION_CONFIG_CHOICES:
      raise ValueError(f'--generation-config={self.generation_config!r}: choose one of '
                       f'{GENERATION_CONFIG_CHOICES}.')
    self.speculative()
    self.lora_module_paths()

  def lora_module_paths(self) -> dict[str, str]:
    """--lora-modules as {name: directory}, checked."""
    if (self.lora_modules or self.max_loras != 1 or self.max_lora_rank != 16
        or self.max_cpu_loras) and not self.enable_lora:
      raise ValueError('--lora-modules, --max-loras, --max-lora-rank and --max-cpu-loras '
                       'need --enable-lora.')
    for name in ('max_loras', 'max_lora_rank'):
      if getattr(self, name) < 1:
        raise ValueError(f'--{_flag(name)}={getattr(self, name)}: must be at least 1.')
    if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
      raise ValueError(f'--max-cpu-loras={self.max_cpu_loras} is less than --max-loras='
                       f'{self.max_loras}: give at least as many (or 0: --max-loras).')
    out = {}
    for item in self.lora_modules:
      name, sep, path = item.partition('=')
      if not sep or not name or not path:
        raise ValueError(f'--lora-modules {item!r}: give NAME=DIR (a PEFT adapter directory '
                         'or a LoRA run\'s workdir).')
      if name in out:
        raise ValueError(f'--lora-modules: the name {name!r} is given twice.')
      out[name] = path
    cpu = self.max_cpu_loras or self.max_loras
    if len(out) > cpu:
      raise ValueError(f'--lora-modules names {len(out)} adapters, more than --max-cpu-loras='
                       f'{cpu} loaded at once; raise --max-cpu-loras to {len(out)}.')
    return out

  def speculative(self) -> SpeculativeConfig | None:
    """The parsed --speculative-config (serve.spec.config.SpeculativeConfig) or None."""
    return parse_speculative_config(self.speculative_config)


def _flag(name: str) -> str:
  return name.replace('_', '-')


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Model source (--checkpoint or --hf-model) and one flag per ServeConfig field."""
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument('--checkpoint', metavar='DIR', help='a train.py workdir')
  source.add_argument('--hf-model', metavar='DIR',
                      help='a Hugging Face Llama directory (config.json, *.safetensors, '
                      'tokenizer.json)')
  parser.add_argument('--chat-template', metavar='FILE', default=None,
                      help="a jinja2 chat template to use instead of the model's own")
  parser.add_argument('--compilation-cache-dir', metavar='DIR', default=compile_cache.DEFAULT_DIR,
                      help="jax's persistent compilation cache: a restart reads the compiled "
                      "step programs from here; 'none' turns it off (default: %(default)s; "
                      'JAX_COMPILATION_CACHE_DIR, when set, wins)')
  group = parser.add_argument_group('engine')
  for field in dataclasses.fields(ServeConfig):
    flag = f'--{_flag(field.name)}'
    if field.name == 'lora_modules':
      group.add_argument(flag, nargs='+', default=(), metavar='NAME=DIR',
                         help='LoRA adapters (PEFT directories, or LoRA runs\' workdirs) to '
                         'serve, each under its name (the request\'s "model"); needs '
                         '--enable-lora')
    elif field.type in (bool, 'bool'):
      group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
    else:
      kind = {'int': int, 'float': float, 'str': str}.get(field.type, field.type)
      group.add_argument(flag, type=kind, default=field.default)
  return parser


def config_from_args(args: argparse.Namespace) -> ServeConfig:
  cfg = ServeConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)})
  cfg.lora_modules = tuple(cfg.lora_modules)
  cfg.validate()
  return cfg


def resolve_attention(cfg, model_cfg=None) -> str:
  """The paged attention of --attention (cfg.attention): 'auto' is the Pallas kernel on a
  GPU and XLA's elsewhere (both compute sliding windows and soft caps)."""
  del model_cfg
  if cfg.attention != 'auto':
    return cfg.attention
  import jax  # pylint: disable=import-outside-toplevel
  return 'pallas' if jax.default_backend() == 'gpu' else 'xla'


def load_served_model(args: argparse.Namespace, mesh=None):
  """The ServedModel named by --checkpoint or --hf-model."""
  # pylint: disable=import-outside-toplevel
  template = _read_chat_template(args.chat_template) if args.chat_template else None
  from model import kv_quant, paged, quant
  # Whether the device stores the --kv-cache-dtype format, before any weight.
  kv_quant.check_backend(args.kv_cache_dtype, None, resolve_attention(args))

  def check(model_cfg):
    # The attention named is one that exists, before any weight is read.
    paged.check_impl(model_cfg, resolve_attention(args, model_cfg))
    if args.quantization != 'none':   # the format on this device, before any weight
      quant.check_format(args.quantization, model_cfg)

  if args.checkpoint:
    from serve.load.checkpoint import load_checkpoint
    served = load_checkpoint(args.checkpoint, mesh=mesh, dtype=args.dtype, check=check)
  else:
    from serve.load.hf_model import load_hf_model
    served = load_hf_model(args.hf_model, dtype=args.dtype,
                           generation_config=args.generation_config, check=check,
                           quantization=args.quantization)
  return served if template is None else dataclasses.replace(served, chat_template=template)


def _read_chat_template(path: str) -> str:
  """--chat-template's file, checked to parse (before any weight is read)."""
  from serve.api.chat_template import compile_template  # pylint: disable=import-outside-toplevel
  try:
    with open(path, encoding='utf-8') as f:
      source = f.read()
  except OSError as e:
    raise ValueError(f'--chat-template={path!r}: cannot read it ({e.strerror}); give a '
                     'jinja2 template file.') from None
  compile_template(source, where=f'--chat-template {path}')
  return source
