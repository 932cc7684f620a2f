"""A decoder language model written in Flax NNX from scratch, trained by meshlm on its
default corpus (token batches: inputs, targets, positions, segment_ids, weights).

Pre-norm blocks of causal multi-head attention (documents packed in a window attend only
within themselves) and a GELU MLP; learned positions; the output head tied to the token
embedding. Parameters carry the built-in logical names, so the presets' tensor
parallelism and ZeRO apply as they do to meshlm's own model.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from training import user_model

init = nnx.initializers.normal(0.02)


def param(rngs, shape, axes):
  return nnx.Param(init(rngs.params(), shape), out_sharding=axes)


class RMSNorm(nnx.Module):
  def __init__(self, dim):
    self.scale = nnx.Param(jnp.ones(dim), out_sharding=('embed',))

  def __call__(self, x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]


class Block(nnx.Module):
  def __init__(self, dim, heads, mlp, rngs):
    self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
    self.qkv = param(rngs, (3, dim, heads, dim // heads), (None, 'embed', 'heads', 'head_dim'))
    self.out = param(rngs, (heads, dim // heads, dim), ('heads', 'head_dim', 'embed'))
    self.up = param(rngs, (dim, mlp), ('embed', 'mlp'))
    self.down = param(rngs, (mlp, dim), ('mlp', 'embed'))

  def __call__(self, x, mask):                             # x [b, t, d], mask [b, 1, t, s]
    q, k, v = jnp.einsum('btd,cdhe->cbthe', self.attn_norm(x), self.qkv[...])
    attn = jax.nn.dot_product_attention(q, k, v, mask=mask)
    x = x + jnp.einsum('bthe,hed->btd', attn, self.out[...])
    return x + jax.nn.gelu(self.mlp_norm(x) @ self.up[...]) @ self.down[...]


class DecoderLM(nnx.Module):
  def __init__(self, *, vocab=320, dim=128, depth=2, heads=4, mlp=512, max_len=256,
               remat='none', rngs: nnx.Rngs):
    self.remat = remat
    self.embed = param(rngs, (vocab, dim), ('vocab', 'embed'))
    self.pos = param(rngs, (max_len, dim), (None, 'embed'))
    self.blocks = nnx.List([Block(dim, heads, mlp, rngs) for _ in range(depth)])
    self.norm = RMSNorm(dim)

  def __call__(self, tokens, positions, segment_ids):       # [b, t] each -> logits [b, t, v]
    x = self.embed[...][tokens] + self.pos[...][positions]
    t = tokens.shape[1]
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = (same_doc & jnp.tril(jnp.ones((t, t), bool)))[:, None]
    block_fn = user_model.remat(self.remat)(Block.__call__)   # model.remat's policy
    for block in self.blocks:
      x = block_fn(block, x, mask)
    return jnp.einsum('btd,vd->btv', self.norm(x), self.embed[...])


def loss(model: DecoderLM, batch):
  """Next-token cross-entropy summed over the batch's weighted tokens."""
  segments = batch.get('segment_ids', jnp.zeros_like(batch['inputs']))
  logits = model(batch['inputs'], batch['positions'], segments).astype(jnp.float32)
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch['targets'][..., None], -1)
  return jnp.sum(nll[..., 0] * batch['weights'])
