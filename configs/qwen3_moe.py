"""A Qwen3-30B-A3B-shaped mixture of experts: ~30B parameters, ~3B active a token.

48 layers, 2048 wide, grouped-query attention of 32 query / 4 KV heads of 128 with Qwen3's
RMSNorm on each query and key head (model.qk_norm); every layer's MLP is 128 routed experts
of width 768, the top 8 by a softmax router, their weights renormalized
(model.router_norm_topk), no shared experts; RoPE base 1e6, untied embeddings of a
151,936-token vocabulary. Exports as Qwen3MoeForCausalLM (`python -m serve.hf_export`);
fine-tune the released weights with --config.init_from_hf=DIR. Launch on 8 H200s: experts
split 8 ways over mesh.expert (77 GiB of fp32 weights, gradients and Adam state a device
before activations, per `--check`); on 16 GPUs add --config.mesh.fsdp=2 (ZeRO-3 halves it).

Variants: '' (the real run, GPU), 'smoke' (same structure, tiny sizes, runs on CPU).
"""

from training.config import Config

VARIANTS = ('', 'smoke')


def get_config(variant: str = '') -> Config:
  cfg = Config(steps=20_000, workdir='runs/qwen3_moe')
  m = cfg.model
  m.vocab_size, m.num_layers, m.embed_dim = 151_936, 48, 2048
  m.num_heads, m.num_kv_heads, m.head_dim, m.qk_norm = 32, 4, 128, True
  m.num_experts, m.experts_per_token, m.num_shared_experts = 128, 8, 0
  m.moe_every, m.moe_mlp_dim, m.router, m.router_norm_topk = 1, 768, 'softmax', True
  m.mlp_dim = 6144   # unused: every layer's MLP is a mixture of experts
  m.moe_aux_loss_coef, m.router_z_loss_coef = 0.001, 0.0
  m.moe_dispatch, m.capacity_factor = 'capacity', 1.25
  m.max_seq_len, m.rope_theta, m.norm_eps = 4096, 1_000_000.0, 1e-6
  m.tie_embeddings, m.remat, m.attention_impl = False, 'full', 'cudnn'
  m.dtype, m.param_dtype, m.loss_chunk = 'bfloat16', 'float32', 1024
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert = 1, 1, 8
  cfg.parallel.zero_stage = 3
  cfg.data.seq_len, cfg.data.batch_size = 4096, 64
  cfg.optim.learning_rate, cfg.optim.warmup_steps = 3e-4, 1000
  cfg.checkpoint.every_steps, cfg.checkpoint.keep = 1000, 3
  if variant == 'smoke':
    m.vocab_size, m.num_layers, m.embed_dim, m.mlp_dim = 512, 2, 64, 128
    m.num_heads, m.num_kv_heads, m.head_dim = 4, 2, 16
    m.num_experts, m.experts_per_token, m.moe_mlp_dim = 8, 2, 32
    m.max_seq_len, m.attention_impl, m.dtype, m.loss_chunk = 128, 'xla', 'float32', 0
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert = -1, 1, 1
    cfg.parallel.zero_stage = 0
    cfg.data.seq_len, cfg.data.batch_size, cfg.data.corpus_max_mb = 64, 8, 1
    cfg.optim.learning_rate, cfg.optim.warmup_steps = 3e-3, 1
    cfg.steps, cfg.checkpoint.every_steps = 3, 2
    cfg.workdir = 'runs/qwen3_moe_smoke'
  elif variant:
    raise ValueError(f'configs/qwen3_moe.py has variants "" and "smoke", not {variant!r}.')
  return cfg
