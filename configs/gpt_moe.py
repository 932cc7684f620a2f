"""A ~14B-parameter (~2B active) mixture-of-experts GPT, DeepSeek-V2-Lite-style.

Every layer's MLP is a mixture of 64 fine-grained routed experts (width 1408, top-6 by a
softmax router, weights renormalized) plus 2 shared experts every token goes through,
on a 24-layer, 2048-wide decoder with grouped-query attention (16 query / 4 KV heads of
128; DeepSeek uses MLA, which meshlm does not have). Experts are split 8 ways over
mesh.expert (expert parallelism, all-to-all token dispatch with capacity factor 1.25;
the 8 expert devices also split the batch). Launch on 8 GPUs: `python train.py
--config=gpt_moe.py`: each holds 1/8 of the experts and the dense rest whole (41 GiB of
fp32 weights, gradients and Adam state before activations, per `--check`). On 16, 32, ...
GPUs add --config.mesh.fsdp=2, 4, ...: ZeRO-3 shards parameters and optimizer state over
fsdp too.

Variants: '' (the real run, GPU), 'smoke' (same structure, tiny sizes, one dense and one
MoE layer, runs on CPU on any device count; try
`--config.mesh.expert=4 --config.mesh.data=2` on 8 simulated devices).
"""

from training.config import Config

VARIANTS = ('', 'smoke')


def get_config(variant: str = '') -> Config:
  cfg = Config(steps=50_000, workdir='runs/gpt_moe')
  m = cfg.model
  m.vocab_size, m.num_layers, m.embed_dim, m.mlp_dim = 102_400, 24, 2048, 10_944
  m.num_heads, m.num_kv_heads, m.head_dim = 16, 4, 128
  m.num_experts, m.experts_per_token, m.num_shared_experts = 64, 6, 2
  m.moe_every, m.moe_mlp_dim, m.router = 1, 1408, 'softmax'
  m.moe_aux_loss_coef, m.router_z_loss_coef = 0.003, 0.001
  m.moe_dispatch, m.capacity_factor = 'capacity', 1.25
  m.max_seq_len, m.rope_theta = 4096, 10_000.0
  m.tie_embeddings, m.remat, m.attention_impl = False, 'full', 'cudnn'
  m.dtype, m.param_dtype, m.loss_chunk = 'bfloat16', 'float32', 1024
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert = 1, 1, 8
  cfg.parallel.zero_stage = 3
  cfg.data.seq_len, cfg.data.batch_size = 4096, 64
  cfg.optim.learning_rate, cfg.optim.warmup_steps = 4.2e-4, 2000
  cfg.checkpoint.every_steps, cfg.checkpoint.keep = 1000, 3
  if variant == 'smoke':
    m.vocab_size, m.num_layers, m.embed_dim, m.mlp_dim = 512, 2, 64, 128
    m.num_heads, m.num_kv_heads, m.head_dim = 4, 1, 16
    m.num_experts, m.experts_per_token, m.num_shared_experts = 8, 2, 1
    m.moe_every, m.moe_mlp_dim = 2, 32
    m.max_seq_len, m.attention_impl, m.dtype, m.loss_chunk = 128, 'xla', 'float32', 0
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert = -1, 1, 1
    cfg.data.seq_len, cfg.data.batch_size, cfg.data.corpus_max_mb = 64, 8, 1
    cfg.optim.learning_rate, cfg.optim.warmup_steps = 3e-3, 1
    cfg.steps, cfg.checkpoint.every_steps = 3, 2
    cfg.workdir = 'runs/gpt_moe_smoke'
  elif variant:
    raise ValueError(f'configs/gpt_moe.py has variants "" and "smoke", not {variant!r}.')
  return cfg
