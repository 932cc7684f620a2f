"""LoRA's model contract (model/lora.py): the delta forms against float64 NumPy, the model
with an adapter against the model with merged weights, and the config's bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import lora
from model.lora import LoraConfig
from tests.test_model import make_params, tiny_cfg


def random_adapter(cfg, lcfg, seed=0, std=0.3):
  """Random a AND b (init_adapter's b is zero: the delta would vanish)."""
  abstract = lora.abstract_adapter(cfg, lcfg)
  leaves, treedef = jax.tree.flatten(abstract)
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(treedef, [jnp.asarray(rng.normal(0, std, s.shape), jnp.float32)
                                      for s in leaves])


def test_delta_matches_float64_numpy():
  rng = np.random.default_rng(0)
  x, a, b = rng.normal(size=(2, 5, 12)), rng.normal(size=(12, 3)), rng.normal(size=(3, 7))
  got = lora.delta(jnp.asarray(x, jnp.float32), jnp.asarray(a), jnp.asarray(b), 0.75)
  np.testing.assert_allclose(np.asarray(got), 0.75 * (x @ a) @ b, rtol=1e-5, atol=1e-5)


def test_delta_rows_three_slots_equal_each_row_alone():
  rng = np.random.default_rng(1)
  slots, fan_in, r, fan_out, rows = 4, 10, 3, 6, 9
  a = rng.normal(size=(slots, fan_in, r))
  b = rng.normal(size=(slots, r, fan_out))
  a[0], b[0] = 0, 0   # slot 0: no adapter
  x = rng.normal(size=(1, rows, fan_in))
  row_slot = np.array([0, 1, 2, 3, 1, 0, 3, 2, 1], np.int32)
  got = np.asarray(lora.delta_rows(jnp.asarray(x, jnp.float32), jnp.asarray(a, jnp.float32),
                                   jnp.asarray(b, jnp.float32), jnp.asarray(row_slot)))
  assert got.shape == (1, rows, fan_out)
  for i, s in enumerate(row_slot):
    alone = lora.delta(jnp.asarray(x[:, i:i + 1], jnp.float32), jnp.asarray(a[s], jnp.float32),
                       jnp.asarray(b[s], jnp.float32), 1.0)
    np.testing.assert_allclose(got[0, i], np.asarray(alone)[0, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0, i], x[0, i] @ a[s] @ b[s], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[0, row_slot == 0], 0.0)


def _logits(cfg, params, tokens, lora_form=None):
  hidden = model.forward(params, tokens, cfg, lora=lora_form)
  return np.asarray(model.logits(params, hidden, cfg))


@pytest.mark.parametrize('targets,layers,rslora', [
    (tuple(lora.TARGETS), (), False),
    (('q', 'o', 'down'), (1,), True),
])
def test_adapter_equals_merged_weights(targets, layers, rslora):
  cfg = tiny_cfg()
  lcfg = LoraConfig(rank=3, alpha=5.0, targets=targets, layers=layers, rslora=rslora)
  lcfg.validate(cfg)
  params = make_params(cfg)
  adapter = random_adapter(cfg, lcfg)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  with_adapter = _logits(cfg, params, tokens, lora.layer_form(adapter, lcfg, cfg))
  merged = _logits(cfg, lora.merge(params, adapter, lcfg, cfg), tokens)
  base = _logits(cfg, params, tokens)
  assert np.abs(with_adapter - base).max() > 1e-2   # the adapter changes something
  np.testing.assert_allclose(with_adapter, merged, rtol=2e-5, atol=2e-5)


def test_unselected_layers_and_fresh_adapter_change_nothing():
  cfg = tiny_cfg()
  params = make_params(cfg)
  tokens = jax.random.randint(jax.random.key(2), (1, 8), 0, cfg.vocab_size)
  base = _logits(cfg, params, tokens)
  lcfg = LoraConfig(rank=2, targets=('q', 'gate'))
  fresh = lora.init_adapter(cfg, lcfg, jax.random.key(0))
  np.testing.assert_array_equal(_logits(cfg, params, tokens, lora.layer_form(fresh, lcfg, cfg)),
                                base)
  nowhere = dataclasses.replace(lcfg, layers=(0,))
  adapter = random_adapter(cfg, nowhere)
  adapter = jax.tree.map(lambda w: w.at[0].set(0.0), adapter)   # layer 0 a zero delta
  np.testing.assert_allclose(
      _logits(cfg, params, tokens, lora.layer_form(adapter, nowhere, cfg)), base,
      rtol=1e-6, atol=1e-6)


def test_specs_follow_the_base_axes():
  cfg = tiny_cfg()
  specs = lora.adapter_specs(cfg, LoraConfig(rank=4, targets=('q', 'o', 'down')))['layers']
  H, E, D, F = cfg.num_heads, cfg.resolved_head_dim, cfg.embed_dim, cfg.resolved_mlp_dim
  assert specs['q'] == {'a': ((2, D, 4), ('layers', 'embed', None)),
                        'b': ((2, 4, H * E), ('layers', None, 'heads'))}
  assert specs['o'] == {'a': ((2, H * E, 4), ('layers', 'heads', None)),
                        'b': ((2, 4, D), ('layers', None, 'embed'))}
  assert specs['down']['a'] == ((2, F, 4), ('layers', 'mlp', None))


def test_moe_model_adapts_attention_in_both_stacks_and_matches_merged():
  cfg = tiny_cfg(num_experts=4, experts_per_token=2, moe_every=2, moe_dispatch='dropless')
  lcfg = LoraConfig(rank=2, targets=('q', 'v', 'up'))
  lcfg.validate(cfg)
  adapter = random_adapter(cfg, lcfg)
  assert set(adapter) == {'layers', 'moe_layers'}
  assert set(adapter['moe_layers']) == {'q', 'v'} and set(adapter['layers']) == {'q', 'v', 'up'}
  params = make_params(cfg)
  tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, cfg.vocab_size)
  np.testing.assert_allclose(
      _logits(cfg, params, tokens, lora.layer_form(adapter, lcfg, cfg)),
      _logits(cfg, lora.merge(params, adapter, lcfg, cfg), tokens), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('field,value,message', [
    ('rank', 0, 'lora.rank=0 must be > 0'),
    ('rank', -2, 'lora.rank=-2 must be > 0'),
    ('targets', ('q', 'qkv'), "lora.targets=('q', 'qkv'): ['qkv']; choose among"),
    ('layers', (5,), 'lora.layers=(5,): [5] out of range for a model of 2 layers'),
    ('dropout', 1.0, 'lora.dropout=1.0 must be in [0, 1)'),
])
def test_bad_config_one_line(field, value, message):
  lcfg = dataclasses.replace(LoraConfig(rank=4), **{field: value})
  with pytest.raises(ValueError, match='^' + message.replace('(', r'\(').replace(')', r'\)')
                     .replace('[', r'\[').replace(']', r'\]')) as err:
    lcfg.validate(tiny_cfg())
  assert '\n' not in str(err.value)


def test_target_the_model_lacks_is_refused():
  cfg = tiny_cfg(num_experts=4, experts_per_token=2, moe_dispatch='dropless')   # all MoE
  with pytest.raises(ValueError, match=r"lora.targets \['gate'\]: this model has no such "):
    LoraConfig(rank=2, targets=('q', 'gate')).validate(cfg)


@pytest.mark.parametrize('unstacked', [False, True])
def test_serving_forward_with_attached_adapter_equals_training_forward(unstacked):
  """model.paged's forward runs the same projections: params with the layer form attached
  (lora.attach, stacked or unstack_layers' per-layer tuple) give the training forward's
  logits with the adapter."""
  from model import paged  # pylint: disable=import-outside-toplevel
  cfg = tiny_cfg()
  lcfg = LoraConfig(rank=2, alpha=4.0, targets=tuple(lora.TARGETS), layers=(1,))
  params, adapter = make_params(cfg), random_adapter(cfg, lcfg)
  form = lora.layer_form(adapter, lcfg, cfg)
  tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, 11).astype(np.int32)
  t, page = len(tokens), 4
  pages = -(-t // page)
  batch = paged.PagedBatch(
      tokens=jnp.asarray(tokens), positions=jnp.arange(t, dtype=jnp.int32),
      slots=jnp.arange(t, dtype=jnp.int32), kv_lens=jnp.asarray([t], jnp.int32),
      page_indices=jnp.arange(pages, dtype=jnp.int32)[None],
      cu_q_lens=jnp.asarray([0, t], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32),
      sample_rows=jnp.arange(t, dtype=jnp.int32))
  served = paged.unstack_layers(params, cfg) if unstacked else params
  got, _ = paged.sampled_logits(lora.attach(served, form),
                                paged.init_kv_cache(cfg, pages, page), batch, cfg)
  want = _logits(cfg, params, jnp.asarray(tokens)[None], form)[0]
  assert np.abs(want - _logits(cfg, params, jnp.asarray(tokens)[None])[0]).max() > 1e-2
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_rows_never_see_another_slots_non_finite_product():
  """delta_rows applies every slot's A to every row: a slot whose product overflows (or an
  adapter with an inf) must not reach the rows of other slots, base rows included."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4, 8)) * 40, jnp.float16)
  a = np.zeros((3, 8, 2), np.float16)
  a[1] = rng.normal(size=(8, 2)) * 0.01
  a[2] = 30.0                                   # x @ a[2] overflows float16 on every row
  b = np.zeros((3, 2, 5), np.float16)
  b[1] = rng.normal(size=(2, 5)) * 0.01
  row_slot = jnp.asarray([0, 1, 1, 0])
  got = np.asarray(lora.delta_rows(x, jnp.asarray(a), jnp.asarray(b), row_slot), np.float32)
  assert np.isfinite(got).all(), got
  assert (got[[0, 3]] == 0).all()
  want = (np.asarray(x, np.float32)[1:3] @ a[1].astype(np.float32)) @ b[1].astype(np.float32)
  np.testing.assert_allclose(got[1:3], want, rtol=2e-2, atol=1e-3)


def test_a_non_finite_peft_adapter_is_refused(tmp_path):
  from model import lora_peft  # pylint: disable=import-outside-toplevel
  cfg = tiny_cfg()
  lcfg = lora.LoraConfig(rank=2, alpha=4.0, targets=('q',))
  adapter = jax.tree.map(np.asarray, lora.init_adapter(cfg, lcfg, jax.random.key(0)))
  adapter['layers']['q']['b'] = np.full_like(adapter['layers']['q']['b'], np.inf)
  lora_peft.write_peft_adapter(str(tmp_path), adapter, lcfg, cfg)
  with pytest.raises(ValueError, match='non-finite values'):
    lora_peft.read_peft_adapter(str(tmp_path), cfg)
