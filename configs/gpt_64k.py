"""A ~1.2B-parameter Llama-style GPT trained on 65,536-token sequences.

Llama-3.2-1B shape (16 layers, 2048 wide, 32 query / 8 KV heads, tied embeddings), RoPE
theta 500k scaled 8x from an 8K original context, full remat, chunked loss, ZeRO-3 over
mesh.fsdp, and context parallelism over mesh.context: ring attention with the Pallas
flash kernel on each chunk, causally load-balanced. Documents are not packed (plain
causal attention, no segment ids). Point data.tokenizer / data.train_files at a real
tokenizer and corpus for a real run; the defaults (byte tokenizer, stdlib corpus) only
make the config runnable anywhere.

Launch on one 80 GB GPU (context 1: the flash kernel over the whole sequence; one
sequence per microbatch):

  python train.py --config=gpt_64k.py --config.optim.grad_accum=8

On 8 GPUs of one host, 4-way context x 2-way FSDP (each device holds 16K tokens of a
sequence and half of the parameters' shards; 4 sequences per FSDP shard, 2 per
microbatch):

  python train.py --config=gpt_64k.py --config.mesh.context=4 --config.optim.grad_accum=2

benchmarks/memory_gpt_64k.py compiles both from abstract shapes and records the
per-device memory (benchmarks/results/memory_gpt_64k.json). The fastest of the measured
settings is --config.model.remat=save_attention (the backward runs no attention forward,
for more memory a device) with --config.model.attention_impl=cudnn, or pallas (the Mosaic
GPU flash kernels on Hopper); step times and MFU of each are in docs/benchmarks.md and
benchmarks/results/train_gpt_64k_65536_*_gpu.json.

Variants: '' (the real run, GPU), 'smoke' (same structure, tiny sizes, runs on CPU with
mesh.context=4).
"""

from training.config import Config

VARIANTS = ('', 'smoke')


def get_config(variant: str = '') -> Config:
  cfg = Config(steps=20_000, workdir='runs/gpt_64k')
  m = cfg.model
  m.vocab_size, m.num_layers, m.embed_dim, m.mlp_dim = 128_256, 16, 2048, 8192
  m.num_heads, m.num_kv_heads, m.head_dim = 32, 8, 64
  m.max_seq_len, m.rope_theta = 65_536, 500_000.0
  m.rope_scaling_factor, m.rope_original_max_len = 8.0, 8192
  m.tie_embeddings, m.remat, m.attention_impl = True, 'full', 'pallas'
  m.dtype, m.param_dtype, m.loss_chunk = 'bfloat16', 'float32', 4096
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.context = 1, -1, 1
  cfg.parallel.zero_stage = 3
  cfg.parallel.context_strategy, cfg.parallel.context_load_balance = 'ring', True
  cfg.data.seq_len, cfg.data.batch_size, cfg.data.pack_documents = 65_536, 8, False
  cfg.optim.learning_rate, cfg.optim.warmup_steps, cfg.optim.b2 = 3e-4, 500, 0.95
  cfg.checkpoint.every_steps, cfg.checkpoint.keep = 500, 3
  if variant == 'smoke':
    m.vocab_size, m.num_layers, m.embed_dim, m.mlp_dim = 512, 2, 64, 192
    m.num_heads, m.num_kv_heads, m.head_dim = 4, 1, 16
    m.max_seq_len, m.rope_original_max_len = 512, 64
    m.attention_impl, m.dtype, m.loss_chunk = 'xla', 'float32', 128
    cfg.data.seq_len, cfg.data.batch_size, cfg.data.corpus_max_mb = 512, 8, 1
    cfg.steps, cfg.checkpoint.every_steps = 3, 2
    cfg.mesh.fsdp, cfg.mesh.context = 2, 4   # CP 4 x FSDP 2 on 8 (simulated) CPU devices
    cfg.workdir = 'runs/gpt_64k_smoke'
  elif variant:
    raise ValueError(f'configs/gpt_64k.py has variants "" and "smoke", not {variant!r}.')
  return cfg
