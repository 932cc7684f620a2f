"""Low-rank adapters (LoRA) on the transformer's projections, for training and serving.

The contract (training, export and serving all rely on it):

An adapter is a tree mirroring the base's stacked (scanned) layer groups,
`{'layers': {target: {'a': [L, in, r], 'b': [L, r, out]}}}` (a mixture-of-experts model
also `'moe_layers'`, for the attention targets of its routed layers). A target is one of
TARGETS: q, k, v, o, gate, up, down (Hugging Face's q_proj ... down_proj); in / out are
that HF Linear's flattened sizes, so per layer `a` = PEFT's lora_A.weight.T and `b` =
lora_B.weight.T. A mixture-of-experts model's routed experts take EXPERT_TARGETS
(experts_gate, experts_up, experts_down; gate/up/down stay the dense layers' MLP): one
adapter per expert, `{'a': [L, E, in, r], 'b': [L, E, r, out]}` under 'moe_layers', applied
inside model.moe's dispatch so each expert's delta sees exactly the tokens routed to it.
Layers a LoraConfig leaves out hold zeros there and are scaled by 0.
The scale alpha / r (alpha / sqrt(r) with rslora) is applied at apply time:
`delta(x, a, b, scale)` = scale * (x @ a) @ b. Logical axes follow the base weight's: `a`
takes the base's input axis and an unsharded rank axis, `b` the rank axis and the base's
(outer) output axis, so adapters shard wherever the base does.

The forward (model.transformer.forward_with_aux(..., lora=...), paged_forward) takes the
adapter in its *layer form*, `layer_form(adapter, lcfg, cfg)`: per stack
`{'scale': [L] float32, target: {'a', 'b'}, ...}` (optionally 'dropout' [L] and
'dropout_key' [L] keys), attached to each stack's layer dict under 'lora' so the layer
scan, the pipeline and the MoE grouping slice it with the weights. `apply(layer, target,
x, y)` adds the delta after each targeted projection; a layer without 'lora' is the
plain model, compiled to the same program.

Serving many adapters in one batch uses the same entry with 'row_slot' instead of
'scale' (every leaf keeps the leading layers axis, so broadcast it: [L, T] int32, each
token row's slot): target -> {'a': [L, slots, in, r_max], 'b': [L, slots, r_max, out]},
ranks zero-padded, each slot's scale folded into its b, slot 0 all zeros (the base).
`delta_rows` computes it with a gather per row, never a merged copy of the base weight.
Expert targets have no per-row form (model.moe.lora_adapters refuses them): their runs
are served merged.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.moe import LORA_TARGETS as EXPERT_TARGETS
from model.params import param_specs

# Our target name -> (the base weight it adapts, its number of input dims after 'layers',
# the Hugging Face module name).
TARGETS = {
    'q': ('wq', 1, 'self_attn.q_proj'),
    'k': ('wk', 1, 'self_attn.k_proj'),
    'v': ('wv', 1, 'self_attn.v_proj'),
    'o': ('wo', 2, 'self_attn.o_proj'),
    'gate': ('w_gate', 1, 'mlp.gate_proj'),
    'up': ('w_up', 1, 'mlp.up_proj'),
    'down': ('w_down', 1, 'mlp.down_proj'),
}
STACKS = ('layers', 'moe_layers')
# Every target name: the dense projections', then the routed experts' (model.moe).
ALL_TARGETS = (*TARGETS, *EXPERT_TARGETS)


@dataclasses.dataclass
class LoraConfig:
  """Low-rank adapters trained on a frozen base (rank 0: no LoRA, the whole model trains)."""
  rank: int = 0
  """r of each adapter; 0 disables LoRA."""
  alpha: float = 16.0
  """The delta is scaled by alpha / rank (alpha / sqrt(rank) with rslora)."""
  dropout: float = 0.0
  """Dropout on each adapter's input while training (PEFT's lora_dropout)."""
  targets: tuple = ('q', 'v')
  """Projections adapted, among q, k, v, o, gate, up, down (a dense MLP's) and
  experts_gate, experts_up, experts_down (each routed expert's, on a mixture of experts)."""
  layers: tuple = ()
  """Layer indices adapted (0-based); (): every layer."""
  rslora: bool = False
  """Rank-stabilized scale alpha / sqrt(rank)."""
  init_from_peft: str = ''
  """Training: a PEFT LoRA adapter directory whose adapters start the run (their rank,
  alpha, targets, layers and rslora must be this section's); '': new adapters."""
  base_checkpoint: str = ''
  """Training: WORKDIR[:STEP], a train.py run whose checkpoint (the newest intact one, or
  STEP's) is the frozen base, its parameters only; its model section must be this run's.
  '': init_from_hf's weights, else the seed's."""

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

  def validate(self, cfg: ModelConfig) -> None:
    """ValueError naming the field and the fix."""
    if self.rank <= 0:
      raise ValueError(f'lora.rank={self.rank} must be > 0 (lora.rank=0 in the config turns '
                       'LoRA off).')
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f'lora.dropout={self.dropout} must be in [0, 1).')
    targets = tuple(self.targets)
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown or not targets:
      raise ValueError(f'lora.targets={targets}: {unknown or "none given"}; choose among '
                       f'{ALL_TARGETS}.')
    bad = [i for i in self.layers if not 0 <= i < cfg.num_layers]
    if bad:
      raise ValueError(f'lora.layers={tuple(self.layers)}: {bad} out of range for a model of '
                       f'{cfg.num_layers} layers (0-based; () for all).')
    present = {t for stack in _base_stacks(cfg).values() for t in ALL_TARGETS
               if base_name(t) in stack}
    missing = [t for t in targets if t not in present]
    if missing:
      raise ValueError(f'lora.targets {missing}: this model has no such projection (gate, '
                       'up, down are a dense MLP\'s; experts_gate, experts_up, experts_down '
                       f'a mixture of experts\'): choose among {sorted(present)}.')
    if self.dropout and set(targets) & set(EXPERT_TARGETS):
      # As PEFT's adapters on expert parameters: the delta is not factored per token.
      raise ValueError(f'lora.dropout={self.dropout} with expert targets: adapters on '
                       'experts take no dropout; set lora.dropout=0.')


def base_name(target: str) -> str:
  """The base weight a target adapts (its name in a layer stack)."""
  return EXPERT_TARGETS[target] if target in EXPERT_TARGETS else TARGETS[target][0]


def _base_stacks(cfg: ModelConfig) -> dict:
  specs = param_specs(cfg)
  return {s: specs[s] for s in STACKS if s in specs}


def stack_layer_indices(cfg: ModelConfig) -> dict[str, list[int]]:
  """The absolute layer index of each position of each stack (model.transformer's
  groups: 'moe_layers' every moe_every-th layer, 'layers' the others)."""
  if not cfg.num_experts:
    return {'layers': list(range(cfg.num_layers))}
  out = {'moe_layers': [i for i in range(cfg.num_layers) if (i + 1) % cfg.moe_every == 0]}
  dense = [i for i in range(cfg.num_layers) if (i + 1) % cfg.moe_every]
  return {**out, 'layers': dense} if dense else out


# ----------------------------------------------------------------------------- parameters

def adapter_specs(cfg: ModelConfig, lcfg: LoraConfig) -> dict:
  """{stack: {target: {'a': (shape, axes), 'b': (shape, axes)}}} for every stack holding
  the target's base weight."""
  out = {}
  for stack, base in _base_stacks(cfg).items():
    for t in lcfg.targets:
      if base_name(t) in base:
        out.setdefault(stack, {})[t] = _target_spec(base[base_name(t)], t, lcfg.rank)
  return out


def _target_spec(w, target: str, rank: int) -> dict:
  """A dense weight [L, in..., out...] -> a [L, in, r], b [L, r, out]; an expert weight
  [L, E, in, out] -> a [L, E, in, r], b [L, E, r, out] (the expert axis kept, so it
  shards over `expert` with its expert)."""
  if target in EXPERT_TARGETS:
    (layers, experts, fan_in, fan_out), (la, ea, ia, oa) = w.shape, w.axes
    return {'a': ((layers, experts, fan_in, rank), (la, ea, ia, None)),
            'b': ((layers, experts, rank, fan_out), (la, ea, None, oa))}
  n_in = TARGETS[target][1]
  fan_in, fan_out = math.prod(w.shape[1:1 + n_in]), math.prod(w.shape[1 + n_in:])
  return {'a': ((w.shape[0], fan_in, rank), ('layers', w.axes[1], None)),
          'b': ((w.shape[0], rank, fan_out), ('layers', None, w.axes[1 + n_in]))}


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def logical_axes(cfg: ModelConfig, lcfg: LoraConfig) -> dict:
  return jax.tree.map(lambda s: s[1], adapter_specs(cfg, lcfg), is_leaf=_is_spec)


def abstract_adapter(cfg: ModelConfig, lcfg: LoraConfig, dtype='float32') -> dict:
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], jnp.dtype(dtype)),
                      adapter_specs(cfg, lcfg), is_leaf=_is_spec)


def init_adapter(cfg: ModelConfig, lcfg: LoraConfig, key: jax.Array, dtype='float32') -> dict:
  """PEFT's initialization: a uniform in +-1/sqrt(in) (kaiming_uniform with a=sqrt(5)),
  b zeros, so training starts at the base model."""
  specs = adapter_specs(cfg, lcfg)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
  paths = [p for p, _ in jax.tree.flatten_with_path(specs, is_leaf=_is_spec)[0]]

  def one(i, path, spec):
    shape = spec[0]
    if path[-1].key == 'b':
      return jnp.zeros(shape, dtype)
    bound = 1.0 / math.sqrt(shape[-2])   # a's fan-in
    return jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -bound,
                              bound).astype(dtype)

  return jax.tree.unflatten(treedef, [one(i, p, s) for i, (p, s) in
                                      enumerate(zip(paths, leaves))])


def layer_scales(cfg: ModelConfig, lcfg: LoraConfig) -> dict[str, np.ndarray]:
  """Per stack, [L] float32: lcfg.scale at the adapted layers, 0 elsewhere."""
  chosen = set(lcfg.layers) if lcfg.layers else set(range(cfg.num_layers))
  return {s: np.array([lcfg.scale if i in chosen else 0.0 for i in idx], np.float32)
          for s, idx in stack_layer_indices(cfg).items()}


def layer_form(adapter: dict, lcfg: LoraConfig, cfg: ModelConfig, dropout_key=None) -> dict:
  """The forward's `lora` argument: per stack the adapter's targets plus 'scale' [L];
  with dropout_key (and lcfg.dropout > 0), per-layer dropout keys."""
  scales = layer_scales(cfg, lcfg)
  out = {}
  for stack, targets in adapter.items():
    entry = {**targets, 'scale': jnp.asarray(scales[stack])}
    if dropout_key is not None and lcfg.dropout > 0:
      n = scales[stack].shape[0]
      entry['dropout_key'] = jax.random.split(jax.random.fold_in(dropout_key, STACKS.index(
          stack)), n)
      entry['dropout'] = jnp.full((n,), lcfg.dropout, jnp.float32)
    out[stack] = entry
  return out


def attach(params: dict, lora: dict | None) -> dict:
  """params with each stack's layer dict carrying its layer-form entry under 'lora'."""
  if not lora:
    return params
  return {**params, **{s: _attach_stack(params[s], entry) for s, entry in lora.items()}}


def _attach_stack(layers, entry):
  if isinstance(layers, (list, tuple)):   # model.paged.unstack_layers' per-layer form
    return tuple({**layer, 'lora': jax.tree.map(lambda x, i=i: x[i], entry)}
                 for i, layer in enumerate(layers))
  return {**layers, 'lora': entry}


# ------------------------------------------------------------------------------- compute

def delta(x: jax.Array, a: jax.Array, b: jax.Array, scale) -> jax.Array:
  """scale * (x @ a) @ b: x [..., in], a [in, r], b [r, out] -> [..., out] in x's dtype."""
  h = jnp.einsum('...i,ir->...r', x, a.astype(x.dtype))
  return jnp.einsum('...r,ro->...o', h * jnp.asarray(scale, x.dtype), b.astype(x.dtype))


def delta_rows(x: jax.Array, a_slots: jax.Array, b_slots: jax.Array,
               row_slot: jax.Array) -> jax.Array:
  """Each row's own adapter: x [..., T, in] (leading dims of size 1 or folded into T's
  count), a_slots [S, in, r], b_slots [S, r, out] (scale folded in), row_slot [T] int ->
  [..., T, out]. Every slot's A on every row, masked to the row's own slot, then every
  slot's B: two matmuls over the few slots, no per-row copy of any weight (a gather of
  each row's A and B would hold T x (in + out) x r) and no merged base; the masked terms
  are selected away (exact zeros; adapters are refused at load unless finite), so each row
  gets its own adapter's product alone."""
  lead, fan_in = x.shape[:-1], x.shape[-1]
  rows = x.reshape(-1, fan_in)
  h = jnp.einsum('ti,sir->tsr', rows, a_slots.astype(x.dtype))          # [T, S, r]
  # A select, not a multiply: 0 * inf is NaN, and another slot's product may overflow.
  own = row_slot[:, None] == jnp.arange(a_slots.shape[0])[None, :]     # [T, S]
  h = jnp.where(own[:, :, None], h, jnp.zeros((), h.dtype))
  return jnp.einsum('tsr,sro->to', h, b_slots.astype(x.dtype)).reshape(*lead, -1)


def _dropped(x, entry, target: str):
  """PEFT's lora_dropout on the adapter's input (the base projection sees x whole)."""
  if 'dropout_key' not in entry:
    return x
  key = jax.random.fold_in(entry['dropout_key'], list(TARGETS).index(target))
  rate = entry['dropout'].astype(x.dtype)
  keep = jax.random.bernoulli(key, 1.0 - entry['dropout'], x.shape)
  return jnp.where(keep, x / (1 - rate), jnp.zeros_like(x))


def apply(layer: dict, target: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """y (a projection of x [b, t, in]) plus the layer's adapter delta for `target`, when
  the layer carries one (see the module docstring); else y itself."""
  entry = layer.get('lora')
  if entry is None or target not in entry:
    return y
  w = entry[target]
  flat = x.reshape(*x.shape[:2], -1)
  if 'row_slot' in entry:
    d = delta_rows(flat, w['a'], w['b'], entry['row_slot'])
  else:
    d = delta(_dropped(flat, entry, target), w['a'], w['b'], entry['scale'])
  return y + d.reshape(y.shape).astype(y.dtype)


# ------------------------------------------------------------------------------- merging

def merge(params: dict, adapter: dict, lcfg: LoraConfig, cfg: ModelConfig) -> dict:
  """Plain weights computing what base + adapter computes: W + scale * a @ b per layer,
  in each weight's dtype (the product in float32)."""
  scales = layer_scales(cfg, lcfg)
  out = dict(params)
  for stack, targets in adapter.items():
    out[stack] = dict(params[stack])
    for t, ab in targets.items():
      name = base_name(t)
      w = params[stack][name]
      prod = jnp.einsum('...ir,...ro->...io', ab['a'].astype(jnp.float32),
                        ab['b'].astype(jnp.float32))   # experts: per expert
      prod = prod * jnp.asarray(scales[stack]).reshape(-1, *[1] * (prod.ndim - 1))
      out[stack][name] = (w.astype(jnp.float32) + prod.reshape(w.shape)).astype(w.dtype)
  return out
