"""A Gemma-3-1B-shaped decoder: ~1.0B parameters, 302M of them the tied embeddings.

26 layers, 1152 wide, 4 query heads and 1 KV head of 256 with Gemma 3's q/k norms; a
GeGLU MLP of 6912 (gelu tanh); RMSNorm by (1 + w) before and after attention and MLP;
embeddings scaled by sqrt(1152); queries by 256**-0.5 (query_pre_attn_scalar); five layers
of a 512-token sliding window (RoPE base 1e4) to one global layer (base 1e6), the
alternation carried through the layer scan; a 262,144-token vocabulary. Exports as
Gemma3ForCausalLM (`python -m serve.hf_export`); fine-tune the released weights with
--config.init_from_hf=DIR (its config.json then decides the shape). Launch on 8 GPUs,
parameters, gradients and Adam state split 8 ways (ZeRO-3 over mesh.fsdp): the single KV
head leaves tensor parallelism nothing to split.

Variants: '' (the real run, GPU), 'smoke' (same structure, tiny sizes, runs on CPU).
"""

from training.config import Config

VARIANTS = ('', 'smoke')


def get_config(variant: str = '') -> Config:
  cfg = Config(steps=20_000, workdir='runs/gemma3')
  m = cfg.model
  m.vocab_size, m.num_layers, m.embed_dim, m.mlp_dim = 262_144, 26, 1152, 6912
  m.num_heads, m.num_kv_heads, m.head_dim, m.qk_norm = 4, 1, 256, True
  m.mlp_activation, m.norm_plus_one, m.embed_scale, m.sandwich_norms = (
      'gelu_tanh', True, True, True)
  m.query_pre_attn_scalar, m.sliding_window, m.global_every = 256.0, 512, 6
  m.rope_theta, m.rope_local_theta, m.norm_eps = 1_000_000.0, 10_000.0, 1e-6
  m.max_seq_len, m.tie_embeddings, m.hf_architecture = 32_768, True, 'Gemma3ForCausalLM'
  m.remat, m.attention_impl = 'full', 'pallas'
  m.dtype, m.param_dtype, m.loss_chunk = 'bfloat16', 'float32', 1024
  cfg.mesh.data, cfg.mesh.fsdp = 1, 8
  cfg.parallel.zero_stage = 3
  cfg.data.seq_len, cfg.data.batch_size = 4096, 64
  cfg.optim.learning_rate, cfg.optim.warmup_steps = 3e-4, 1000
  cfg.checkpoint.every_steps, cfg.checkpoint.keep = 1000, 3
  if variant == 'smoke':
    m.vocab_size, m.num_layers, m.embed_dim, m.mlp_dim = 512, 6, 64, 128
    m.num_heads, m.num_kv_heads, m.head_dim = 4, 1, 16
    m.query_pre_attn_scalar, m.sliding_window = 16.0, 16
    m.max_seq_len, m.attention_impl, m.dtype, m.loss_chunk = 128, 'xla', 'float32', 0
    cfg.mesh.data, cfg.mesh.fsdp = -1, 1
    cfg.parallel.zero_stage = 0
    cfg.data.seq_len, cfg.data.batch_size, cfg.data.corpus_max_mb = 64, 8, 1
    cfg.optim.learning_rate, cfg.optim.warmup_steps = 3e-3, 1
    cfg.steps, cfg.checkpoint.every_steps = 3, 2
    cfg.workdir = 'runs/gemma3_smoke'
  elif variant:
    raise ValueError(f'configs/gemma3.py has variants "" and "smoke", not {variant!r}.')
  return cfg
