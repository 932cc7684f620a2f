"""A small vision transformer in Flax NNX, trained by meshlm on synthetic images.

Every parameter names its logical axes (`out_sharding=`); the config's rules map the one
name of its own, 'classes', onto the built-in 'vocab' (split over mesh.tensor). The
layer norms' scales and biases are left unannotated: replicated, and listed at start.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from training import user_model

init = nnx.initializers.normal(0.02)


def param(rngs, shape, axes):
  return nnx.Param(init(rngs.params(), shape), out_sharding=axes)


class Block(nnx.Module):
  def __init__(self, dim, heads, mlp, rngs):
    self.norm1, self.norm2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
    self.qkv = param(rngs, (3, dim, heads, dim // heads), (None, 'embed', 'heads', 'head_dim'))
    self.out = param(rngs, (heads, dim // heads, dim), ('heads', 'head_dim', 'embed'))
    self.up = param(rngs, (dim, mlp), ('embed', 'mlp'))
    self.down = param(rngs, (mlp, dim), ('mlp', 'embed'))

  def __call__(self, x):                                   # x [b, t, d]
    q, k, v = jnp.einsum('btd,cdhe->cbthe', self.norm1(x), self.qkv[...])
    attn = jax.nn.dot_product_attention(q, k, v)           # [b, t, h, e]
    x = x + jnp.einsum('bthe,hed->btd', attn, self.out[...])
    return x + jax.nn.gelu(self.norm2(x) @ self.up[...]) @ self.down[...]


class ViT(nnx.Module):
  def __init__(self, *, image=16, patch=4, dim=64, depth=2, heads=4, mlp=128,
               classes=8, remat='none', rngs: nnx.Rngs):
    self.patch, self.remat = patch, remat
    self.embed = param(rngs, (patch * patch * 3, dim), (None, 'embed'))
    self.pos = param(rngs, ((image // patch) ** 2, dim), (None, 'embed'))
    self.blocks = nnx.List([Block(dim, heads, mlp, rngs) for _ in range(depth)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = param(rngs, (dim, classes), ('embed', 'classes'))

  def __call__(self, images):                              # images [b, h, w, 3]
    b, h, w, c = images.shape
    p = self.patch
    x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(b, -1, p * p * c) @ self.embed[...] + self.pos[...]
    block_fn = user_model.remat(self.remat)(Block.__call__)   # model.remat's policy
    for block in self.blocks:
      x = block_fn(block, x)
    return self.norm(x).mean(axis=1) @ self.head[...]      # [b, classes]


def loss(model: ViT, batch):
  """Cross-entropy summed over the batch, each example weighted."""
  logits = model(batch['images']).astype(jnp.float32)
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch['labels'][:, None], 1)[:, 0]
  return jnp.sum(nll * batch['weights'])


def synthetic_batch(seed: int, index: int, batch_size: int, image=16, classes=8):
  """Batch `index`: each class a fixed random picture, each image one of them in noise."""
  rng = np.random.default_rng([seed, index])
  pictures = np.random.default_rng(1234).standard_normal((classes, image, image, 3))
  labels = rng.integers(0, classes, batch_size).astype(np.int32)
  noise = rng.standard_normal((batch_size, image, image, 3))
  images = (0.5 * pictures[labels] + noise).astype(np.float32)
  return {'images': images, 'labels': labels, 'weights': np.ones(batch_size, np.float32)}
