"""Model hyper-parameters: a few knobs, the rest derived."""

import dataclasses

import numpy as np

ATTENTION_IMPLS = ('xla', 'cudnn', 'pallas')
# The flash kernels attention_impl='pallas' runs (pallas_kernels.flash_attention's backend).
PALLAS_BACKENDS = ('auto', 'triton', 'mosaic_gpu', 'mosaic_gpu_fused')
REMAT_POLICIES = ('none', 'full', 'save_attention', 'save_matmuls', 'offload')
ROUTERS = ('softmax', 'sigmoid')
MOE_DISPATCH = ('capacity', 'dropless')
MLP_ACTIVATIONS = ('silu', 'gelu_tanh')
ROPE_SCALINGS = ('llama3', 'linear')


@dataclasses.dataclass
class ModelConfig:
  """The transformer's shape, numerics and kernels."""
  vocab_size: int = 320
  """Embedding rows; at least the tokenizer's vocabulary (pad it for even sharding)."""
  num_layers: int = 4
  """Transformer blocks (scanned: compile time does not grow with depth)."""
  embed_dim: int = 256
  """Width of the residual stream."""
  num_heads: int = 4
  """Query heads."""
  num_kv_heads: int = 2
  """Key/value heads (grouped-query attention); must divide num_heads."""
  head_dim: int = 0
  """Per-head width; 0: embed_dim // num_heads."""
  mlp_dim: int = 0
  """SwiGLU hidden width; 0: 8/3 * embed_dim rounded up to mlp_multiple."""
  mlp_multiple: int = 64
  """Rounding of the derived mlp_dim."""
  max_seq_len: int = 2048
  """Longest sequence the model is built for (training and serving)."""
  rope_theta: float = 10000.0
  """RoPE base frequency."""
  rope_scaling_factor: float = 1.0
  """Llama-3 RoPE scaling: long wavelengths slowed this much; 1.0 disables it."""
  rope_original_max_len: int = 8192
  """Llama-3 RoPE scaling: the context the unscaled frequencies were trained for."""
  rope_low_freq_factor: float = 1.0
  """Llama-3 RoPE scaling: wavelengths above original_max_len / this are scaled fully."""
  rope_high_freq_factor: float = 4.0
  """Llama-3 RoPE scaling: wavelengths below original_max_len / this are kept."""
  rope_scaling_type: str = 'llama3'
  """How rope_scaling_factor scales: 'llama3' (the band above), or 'linear' (every
  frequency divided by it: Gemma 3's global layers)."""
  rope_local_theta: float = 0.0
  """>0: the RoPE base of the sliding-window layers when global_every alternates them
  (Gemma 3's rope_local_base_freq, unscaled); rope_theta (scaled) stays the global
  layers'. 0: rope_theta in every layer."""
  norm_eps: float = 1e-5
  """RMSNorm epsilon."""
  qkv_bias: bool = False
  """A learned bias on the query, key and value projections (Qwen2/2.5); none on the output."""
  qk_norm: bool = False
  """RMSNorm (norm_eps, a learned scale of head_dim) on each query and key head before RoPE
  (Qwen3)."""
  global_every: int = 0
  """>0: layers alternate, every global_every-th (layers global_every-1, 2*global_every-1,
  ...) attending the whole context and the others the sliding_window (Gemma 2: 2, Gemma 3:
  6); the per-layer choice travels through the layer scan as an array. 0: every layer
  alike."""
  sliding_window: int = 0
  """>0: each query attends only the last sliding_window positions, itself included
  (Mistral, Mixtral, Qwen's use_sliding_window); attention_impl xla or pallas, no context
  parallelism; serving's paged attention xla, its cache keeping the keys outside the
  window, masked. 0: the whole context."""
  mlp_activation: str = 'silu'
  """The gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU with the tanh
  approximation: Gemma)."""
  norm_plus_one: bool = False
  """RMSNorm scales x by (1 + w), the weights stored around 0 (Gemma); False: by w."""
  embed_scale: bool = False
  """Embeddings multiplied by sqrt(embed_dim), in the compute dtype (Gemma)."""
  sandwich_norms: bool = False
  """An RMSNorm also on the attention's and the MLP's outputs before each residual add
  (Gemma 2/3's post_attention and post_feedforward norms)."""
  query_pre_attn_scalar: float = 0.0
  """>0: attention scores scaled by query_pre_attn_scalar**-0.5 (Gemma); 0:
  head_dim**-0.5."""
  attn_softcap: float = 0.0
  """>0: attention scores soft-capped, cap * tanh(scores / cap), before the mask and
  softmax (Gemma 2's attn_logit_softcapping); attention_impl xla or pallas (triton)."""
  final_softcap: float = 0.0
  """>0: output logits soft-capped, cap * tanh(logits / cap) (Gemma 2's
  final_logit_softcapping), in the loss and in serving."""
  hf_architecture: str = ''
  """The Hugging Face architecture `python -m serve.hf_export` writes (init_from_hf sets the
  directory's: model/hf.py's FAMILIES); '': the one the fields give (LlamaForCausalLM;
  Qwen2ForCausalLM with qkv_bias; Qwen3ForCausalLM with qk_norm; MixtralForCausalLM with
  experts, Qwen3MoeForCausalLM with experts and qk_norm; else MistralForCausalLM with a
  sliding_window). It changes nothing the model computes."""
  tie_embeddings: bool = True
  """Use the embedding table as the output head (no separate lm_head)."""
  dtype: str = 'float32'
  """Compute dtype of activations and matmuls: float32, bfloat16 or float16."""
  param_dtype: str = 'float32'
  """Master-weight dtype (and optimizer state): float32, bfloat16 or float16."""
  remat: str = 'none'
  """Activation recomputation per block: none, full, save_attention (full, but the fused
  attention kernel's inputs and outputs are kept: the backward runs no attention forward;
  attention_impl pallas or cudnn), save_matmuls, or offload (the block's
  projections and mid-block residual saved in pinned host memory, the rest recomputed)."""
  attention_impl: str = 'xla'
  """Attention: xla (einsums), cudnn (GPU only) or pallas (our flash kernels)."""
  pallas_backend: str = 'auto'
  """Flash kernels for attention_impl=pallas: auto (mosaic_gpu on a Hopper GPU where it
  takes the dtype and head_dim, else triton: flash_attention.default_backend), triton,
  mosaic_gpu (Hopper, bf16/fp16) or mosaic_gpu_fused (the same forward, one-kernel
  backward, head_dim 64/128)."""
  init_std: float = 0.02
  """Standard deviation of the initial weights (residual outputs scaled by depth)."""
  loss_chunk: int = 0
  """>0: logits and loss this many tokens at a time (never all [b, t, vocab] at once)."""
  num_experts: int = 0
  """Routed experts per mixture-of-experts layer; 0: a dense MLP in every layer."""
  experts_per_token: int = 2
  """Routed experts each token goes to (top-k)."""
  num_shared_experts: int = 0
  """Experts every token goes through (DeepSeek), as one SwiGLU of this many experts' width."""
  moe_every: int = 1
  """Every moe_every-th layer is MoE (layers moe_every-1, 2*moe_every-1, ...), the rest dense;
  must divide num_layers."""
  moe_mlp_dim: int = 0
  """Hidden width of one expert (routed or shared); 0: the dense mlp width (Mixtral)."""
  router: str = 'softmax'
  """'softmax' (Mixtral: top-k of the softmax, renormalized) or 'sigmoid' (DeepSeek-V3:
  top-k of per-expert sigmoids, normalized to sum 1)."""
  router_norm_topk: bool = True
  """With experts_per_token > 1, the chosen experts' weights normalized to sum 1 (Mixtral;
  Qwen3-MoE's norm_topk_prob); False: the router's scores as they are (Qwen3-MoE's
  default)."""
  moe_aux_loss_coef: float = 0.01
  """Weight of the load-balancing loss E * sum_i f_i * P_i (Switch/GShard) in the objective."""
  router_z_loss_coef: float = 0.001
  """Weight of the router z-loss, mean logsumexp(router logits)^2 (ST-MoE), in the objective."""
  capacity_factor: float = 1.25
  """moe_dispatch=capacity: each expert takes ceil(capacity_factor * seq_len * k / E)
  tokens of each sequence; later ones are dropped (counted in metrics)."""
  moe_dispatch: str = 'capacity'
  """'capacity' (fixed-size expert buffers, all-to-all over mesh.expert, overflow dropped)
  or 'dropless' (tokens sorted by expert, grouped matmul jax.lax.ragged_dot)."""
  module: str = ''
  """A Flax NNX module to train instead of the built-in transformer, as an import path
  'package.module:Class' (docs/own_model.md); its fields above are then unused but remat."""
  kwargs: dict = dataclasses.field(default_factory=dict)
  """With module: the constructor's keyword arguments (besides rngs, and remat if it takes it)."""
  loss: str = ''
  """With module: 'package.module:function', (module, batch) -> the batch's loss summed over
  its examples (the trainer divides by the sum of batch['weights'])."""

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.embed_dim // self.num_heads

  @property
  def resolved_mlp_dim(self) -> int:
    if self.mlp_dim:
      return self.mlp_dim
    width = 8 * self.embed_dim // 3
    return -(-width // self.mlp_multiple) * self.mlp_multiple

  @property
  def resolved_moe_mlp_dim(self) -> int:
    return self.moe_mlp_dim or self.resolved_mlp_dim

  @property
  def attention_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.resolved_head_dim) ** -0.5

  def layer_is_local(self):
    """[num_layers] bool numpy array: which layers keep to the sliding window (with
    global_every; else every layer alike, None)."""
    if not self.global_every:
      return None
    return (np.arange(self.num_layers) + 1) % self.global_every != 0

  @property
  def num_moe_layers(self) -> int:
    return self.num_layers // self.moe_every if self.num_experts else 0

  def validate(self) -> None:
    """Raises ValueError naming the field and the fix."""
    def need(ok, msg):
      if not ok:
        raise ValueError(msg)
    need(self.attention_impl in ATTENTION_IMPLS,
         f'model.attention_impl={self.attention_impl!r}: choose one of {ATTENTION_IMPLS}.')
    need(self.pallas_backend in PALLAS_BACKENDS,
         f'model.pallas_backend={self.pallas_backend!r}: choose one of {PALLAS_BACKENDS}.')
    mosaic = self.pallas_backend.startswith('mosaic_gpu')
    need(not mosaic or self.dtype in ('bfloat16', 'float16'),
         f"model.pallas_backend={self.pallas_backend!r} runs bfloat16/float16 attention; set "
         f"model.dtype='bfloat16' (it is {self.dtype!r}) or model.pallas_backend='triton'.")
    need(self.sliding_window >= 0, f'model.sliding_window={self.sliding_window} must be >= 0 '
         '(0: attention over the whole context).')
    need(not self.sliding_window or self.attention_impl in ('xla', 'pallas'),
         f'model.sliding_window={self.sliding_window} runs with attention_impl xla or pallas '
         f'(it is {self.attention_impl!r}): set model.attention_impl to one of them.')
    self._validate_gemma(need)
    need(self.remat in REMAT_POLICIES,
         f'model.remat={self.remat!r}: choose one of {REMAT_POLICIES}.')
    need(self.remat != 'save_attention' or self.attention_impl in ('pallas', 'cudnn'),
         f"model.remat='save_attention' keeps attention's inputs and outputs, which only a "
         f"fused kernel makes small (attention_impl={self.attention_impl!r} would keep its "
         f"scores): set model.attention_impl to pallas or cudnn, or use remat='full'.")
    for name in ('vocab_size', 'num_layers', 'embed_dim', 'num_heads', 'num_kv_heads'):
      need(getattr(self, name) > 0, f'model.{name} must be positive, got {getattr(self, name)}.')
    need(self.num_heads % self.num_kv_heads == 0,
         f'model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads='
         f'{self.num_kv_heads} (grouped-query attention).')
    need(self.head_dim > 0 or self.embed_dim % self.num_heads == 0,
         f'model.embed_dim={self.embed_dim} is not divisible by model.num_heads='
         f'{self.num_heads}: set model.head_dim explicitly.')
    need(self.pallas_backend != 'mosaic_gpu_fused' or self.resolved_head_dim in (64, 128),
         f"model.pallas_backend='mosaic_gpu_fused' takes head_dim 64 or 128 (it is "
         f"{self.resolved_head_dim}); use 'mosaic_gpu' (head_dim 64/128/256, the Triton "
         f"backward at 256) or 'triton'.")
    need(self.resolved_head_dim % 2 == 0,
         f'head_dim={self.resolved_head_dim} must be even for RoPE.')
    for name in ('dtype', 'param_dtype'):
      need(getattr(self, name) in ('float32', 'bfloat16', 'float16'),
           f'model.{name}={getattr(self, name)!r}: choose float32, bfloat16 or float16.')
    self._validate_moe(need)

  def _validate_gemma(self, need) -> None:
    need(self.mlp_activation in MLP_ACTIVATIONS,
         f'model.mlp_activation={self.mlp_activation!r}: choose one of {MLP_ACTIVATIONS}.')
    need(self.rope_scaling_type in ROPE_SCALINGS,
         f'model.rope_scaling_type={self.rope_scaling_type!r}: choose one of {ROPE_SCALINGS}.')
    for name in ('global_every', 'rope_local_theta', 'query_pre_attn_scalar', 'attn_softcap',
                 'final_softcap'):
      need(getattr(self, name) >= 0, f'model.{name}={getattr(self, name)} must be >= 0.')
    need(not self.rope_local_theta or self.global_every,
         f'model.rope_local_theta={self.rope_local_theta} is the base of the local layers '
         'global_every alternates: set model.global_every too, or rope_local_theta=0.')
    need(not self.global_every or not self.num_experts,
         f'model.global_every={self.global_every} alternates dense layers only: set '
         'model.num_experts=0 or model.global_every=0.')
    need(not self.attn_softcap or self.attention_impl in ('xla', 'pallas'),
         f'model.attn_softcap={self.attn_softcap} runs with attention_impl xla or pallas (it '
         f'is {self.attention_impl!r}): set model.attention_impl to one of them.')
    need(not self.attn_softcap or not self.pallas_backend.startswith('mosaic_gpu'),
         f'model.attn_softcap={self.attn_softcap}: the Mosaic GPU kernels do not soft-cap; '
         "set model.pallas_backend='triton'.")

  def _validate_moe(self, need) -> None:
    need(self.num_experts >= 0, f'model.num_experts={self.num_experts} must be >= 0 (0: dense).')
    if not self.num_experts:
      return
    need(1 <= self.experts_per_token <= self.num_experts,
         f'model.experts_per_token={self.experts_per_token} must be in [1, model.num_experts='
         f'{self.num_experts}].')
    need(self.num_shared_experts >= 0,
         f'model.num_shared_experts={self.num_shared_experts} must be >= 0.')
    need(self.moe_every >= 1 and self.num_layers % self.moe_every == 0,
         f'model.moe_every={self.moe_every} must be >= 1 and divide model.num_layers='
         f'{self.num_layers}.')
    need(self.moe_mlp_dim >= 0, f'model.moe_mlp_dim={self.moe_mlp_dim} must be >= 0 (0: '
         'the dense mlp width).')
    need(self.router in ROUTERS, f'model.router={self.router!r}: choose one of {ROUTERS}.')
    need(self.moe_dispatch in MOE_DISPATCH,
         f'model.moe_dispatch={self.moe_dispatch!r}: choose one of {MOE_DISPATCH}.')
    need(self.capacity_factor > 0,
         f'model.capacity_factor={self.capacity_factor} must be > 0.')
    for name in ('moe_aux_loss_coef', 'router_z_loss_coef'):
      need(getattr(self, name) >= 0, f'model.{name}={getattr(self, name)} must be >= 0.')
