"""The layout-parity matrix: every combination validate accepts trains like one device.

From a small table of axis sizes (every factorization of 8 devices over data, stage,
fsdp, expert, context, tensor), ZeRO stages, context strategies and load balance,
sequence parallelism, pipeline repeats, MoE dispatch and gradient accumulation, this
module lists every combination, asks `validate` which run, and computes one step's loss
and gradients for any of them: in this process (8 simulated devices) or, run as
`python -m tests.layout_matrix`, in each of several processes that load only the rows
their devices hold (ShardingPlan.process_rows), exactly as the trainer does.
"""

import argparse
import dataclasses
import itertools
import json
import sys

import numpy as np

AXES = ('data', 'stage', 'fsdp', 'expert', 'context', 'tensor')
# Measured: over the whole matrix at float32, the worst relative error of the loss and
# of any gradient leaf against one device is printed by the tests beside this bound.
TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class Combo:
  mesh: tuple[int, ...]           # sizes in AXES order
  zero: int = 0
  context_strategy: str = 'all_gather'
  load_balance: bool = True
  sequence_parallel: bool = True
  repeats: int = 1
  moe: str = 'dense'              # 'dense' | 'capacity' | 'dropless'
  accum: int = 1
  lora: bool = False              # lora_config()'s adapters on a frozen base

  @property
  def name(self) -> str:
    mesh = '.'.join(f'{a}{n}' for a, n in zip(AXES, self.mesh) if n > 1) or 'one'
    parts = [mesh, f'zero{self.zero}', self.moe, f'accum{self.accum}']
    if self.sizes['context'] > 1:
      parts.append(self.context_strategy + ('-lb' if self.load_balance else ''))
    if self.sizes['tensor'] > 1:
      parts.append('sp' if self.sequence_parallel else 'nosp')
    if self.sizes['stage'] > 1:
      parts.append(f'repeats{self.repeats}')
    if self.lora:
      parts.append('lora')
    return '/'.join(parts)

  @property
  def sizes(self) -> dict[str, int]:
    return dict(zip(AXES, self.mesh))

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> 'Combo':
    return cls(**{**d, 'mesh': tuple(d['mesh'])})


def factorizations(devices: int, axes: int = len(AXES)) -> list[tuple[int, ...]]:
  """Every way to write `devices` as an ordered product of `axes` sizes."""
  if axes == 1:
    return [(devices,)]
  return [(d, *rest) for d in range(1, devices + 1) if devices % d == 0
          for rest in factorizations(devices // d, axes - 1)]


def all_combos(devices: int = 8) -> list[Combo]:
  """The whole matrix; options that do nothing on a mesh (a context strategy without a
  context axis, ...) are not varied there."""
  out = []
  for mesh in factorizations(devices):
    sizes = dict(zip(AXES, mesh))
    context = (list(itertools.product(('all_gather', 'ring'), (True, False)))
               if sizes['context'] > 1 else [('all_gather', True)])
    for zero, (strategy, lb), sp, repeats, moe, accum in itertools.product(
        (0, 1, 2, 3), context, (True, False) if sizes['tensor'] > 1 else (True,),
        (1, 2) if sizes['stage'] > 1 else (1,), ('dense', 'capacity', 'dropless'), (1, 2)):
      out.append(Combo(mesh, zero, strategy, lb, sp, repeats, moe, accum))
  return out


def config(combo: Combo, dtype: str = 'float32'):
  """A tiny model on `combo`'s layout; MoE drops tokens (capacity factor 0.5) and its
  load-balancing and z losses are on."""
  # pylint: disable=import-outside-toplevel
  from model.config import ModelConfig
  from sharding.mesh import MeshConfig
  from training.config import Config
  cfg = Config()
  moe = {} if combo.moe == 'dense' else dict(
      num_experts=8, experts_per_token=2, moe_every=2, moe_mlp_dim=32,
      moe_dispatch=combo.moe, capacity_factor=0.5, moe_aux_loss_coef=0.01,
      router_z_loss_coef=0.001)
  cfg.model = ModelConfig(vocab_size=64, num_layers=4, embed_dim=64, num_heads=8,
                          num_kv_heads=4, mlp_dim=128, max_seq_len=16, attention_impl='xla',
                          dtype=dtype, **moe)
  cfg.data.batch_size, cfg.data.seq_len = 8, 16
  cfg.mesh = MeshConfig(**combo.sizes)
  cfg.parallel.zero_stage = combo.zero
  cfg.parallel.context_strategy = combo.context_strategy
  cfg.parallel.context_load_balance = combo.load_balance
  cfg.parallel.sequence_parallel = combo.sequence_parallel
  cfg.parallel.pipeline_repeats = combo.repeats
  cfg.optim.grad_accum = combo.accum
  if combo.lora:
    cfg.lora = lora_config()
  return cfg


def lora_config():
  """Adapters on every projection of some layers (an MoE model's routed layers adapt
  their attention only)."""
  from model.lora import TARGETS, LoraConfig  # pylint: disable=import-outside-toplevel
  return LoraConfig(rank=4, alpha=8.0, targets=tuple(TARGETS), layers=(0, 1, 3))


def reference(combo: Combo) -> Combo:
  """The one-device run `combo` must equal: the same model and accumulation (MoE's aux
  losses are per microbatch, so accumulation changes what MoE computes), nothing split."""
  accum = combo.accum if combo.moe != 'dense' else 1
  return Combo((1,) * len(AXES), moe=combo.moe, accum=accum, lora=combo.lora)


def classify(combos: list[Combo], devices: int = 8):
  """(accepted, [(combo, validate's reason)])."""
  from training import config as config_lib  # pylint: disable=import-outside-toplevel
  accepted, refused = [], []
  for combo in combos:
    try:
      config_lib.validate(config(combo), devices)
      accepted.append(combo)
    except ValueError as e:
      refused.append((combo, str(e)))
  return accepted, refused


def sample(combos: list[Combo], n: int | None, seed: int,
           prefer=lambda c: True) -> list[Combo]:
  """n combos drawn with a fixed seed (all of them when n is None), half from those
  `prefer` picks when there are enough."""
  if n is None or n >= len(combos):
    return list(combos)
  rng = np.random.default_rng(seed)
  liked = [c for c in combos if prefer(c)]
  first = [liked[i] for i in rng.choice(len(liked), min(n // 2, len(liked)), replace=False)]
  rest = [c for c in combos if c not in first]
  return first + [rest[i] for i in rng.choice(len(rest), n - len(first), replace=False)]


def loss_and_grads(cfg, devices=None, seed: int = 0) -> tuple[float, list[np.ndarray]]:
  """One step's loss and gradient leaves (host float64) on batch `seed`."""
  return losses_and_grads(cfg, devices, (seed,))[0]


def losses_and_grads(cfg, devices=None, seeds=(0,)) -> list[tuple[float, list[np.ndarray]]]:
  """One step's loss and gradient leaves (host float64) on each batch of `seeds`, the
  batch assembled from this process's rows as the trainer does."""
  # pylint: disable=import-outside-toplevel
  import jax
  from jax.experimental import multihost_utils
  import model
  from tests.test_parallel import random_batch   # packed documents, random weights
  from training import state, trainer
  plan = trainer.build_plan(cfg, devices)
  axes = state.trainable_axes(cfg)
  place = lambda tree, axes: jax.tree.map(
      lambda h, sh: jax.make_array_from_callback(h.shape, sh, lambda i: np.asarray(h)[i]),
      tree, plan.tree(plan.params, axes))
  host = model.init_params(cfg.model, jax.random.key(0))
  frozen = None
  if cfg.lora.rank:   # the base frozen in the compute dtype, random adapters (b too)
    from tests.test_lora import random_adapter  # pylint: disable=import-outside-toplevel
    frozen = place(jax.tree.map(lambda w: w.astype(cfg.model.dtype), host),
                   model.logical_axes(cfg.model))
    host = random_adapter(cfg.model, cfg.lora, std=0.1)
  params = place(host, axes)
  lo, hi = plan.process_rows(cfg.data.batch_size, cfg.data.seq_len)[jax.process_index()]
  fn = jax.jit(lambda p, f, b: state.loss_and_grads(p, b, cfg, plan, frozen=f),
               out_shardings=(plan.replicated(), plan.tree(plan.grads, axes)))
  out = []
  for seed in seeds:
    local = {k: v[lo:hi] for k, v in random_batch(cfg, seed).items()}
    loss, grads = fn(params, frozen, trainer.assemble_batch(plan, cfg.data, local))
    if jax.process_count() > 1:
      loss, grads = multihost_utils.process_allgather((loss, grads), tiled=True)
    out.append((float(np.asarray(loss, np.float64)),
                [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]))
  return out


def errors(got, want) -> tuple[float, float]:
  """(loss relative error, worst gradient leaf relative error)."""
  from tests.test_parallel import rel_err  # pylint: disable=import-outside-toplevel
  return rel_err(got[0], want[0]), max(rel_err(g, w) for g, w in zip(got[1], want[1]))


def main(argv=None) -> int:
  """One process of a multi-process run: computes each combo and (process 0) writes
  {name: [loss, [grads...]]} as an .npz of flat arrays."""
  p = argparse.ArgumentParser()
  p.add_argument('--combos', required=True, help='JSON list of Combo dicts')
  p.add_argument('--out', required=True)
  p.add_argument('--coordinator', required=True)
  p.add_argument('--num-processes', type=int, required=True)
  p.add_argument('--process-id', type=int, required=True)
  args = p.parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  arrays = {}
  for i, d in enumerate(json.loads(args.combos)):
    loss, grads = loss_and_grads(config(Combo.from_json(d)))
    arrays[f'{i}_loss'] = np.asarray(loss)
    for j, g in enumerate(grads):
      arrays[f'{i}_grad{j}'] = g
    print(f'done {Combo.from_json(d).name}', flush=True)
  if jax.process_index() == 0:
    np.savez(args.out, **arrays)
  return 0


if __name__ == '__main__':
  sys.exit(main())
