"""AdamW with warmup + cosine decay and global-norm clipping (optax)."""

import jax
import optax

from training.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  decay_steps = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=decay_steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)


def _decay_mask(params):
  # Norm scales are not decayed: pulling them to zero fights the normalization.
  return jax.tree_util.tree_map_with_path(
      lambda path, _: 'norm' not in jax.tree_util.keystr(path), params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  adamw = optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=_decay_mask)
  if cfg.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
  return adamw
