"""Weight quantization: --quantization int8|fp8 (model/quant.py) and compressed-tensors
checkpoints (model/compressed_tensors.py).

Each path computes exactly what the float model computes on its dequantized weights (the
values times the scales, worked out here in numpy); the int8 and fp8 values are within
half a step of the weights they quantize; a compressed-tensors directory, written by the
compressed-tensors library from a random transformers Llama, gives transformers' logits
(transformers reading the same directory through that library); what is not read is
refused with the field's name before any weight is read.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import model
from model import quant
from serve import config as config_lib
from serve.engine.core import Engine
from serve.config import ServeConfig
from serve.load import hf_model
from serve.load.hf_model import load_hf_model, with_quantization
from tests.test_paged_forward import tiny_cfg, tiny_runner
from tests.test_serve_hf import write_tokenizer
from tests.test_serve_runner import PROMPT_LENS, runner_greedy, tensor_mesh

FORMATS = ('int8', 'fp8')
LAYER_WEIGHTS = tuple(quant.CONTRACTED)


def numpy_dequantized(params, dtype):
  """Every quantized weight as values * scale (minus the zero point), in numpy: float32,
  exact for these products, rounded once to the compute dtype as the model rounds it."""
  def one(w):
    if not quant.is_quantized(w):
      return w
    values = np.asarray(w.qvalue).astype(np.float32)
    if w.zero_point is not None:
      values = values - np.asarray(w.zero_point).astype(np.float32)
    scale = np.asarray(w.scale.astype(dtype)).astype(np.float32)
    return jnp.asarray((values * scale).astype(jnp.dtype(dtype)))
  return jax.tree.map(one, params, is_leaf=quant.is_quantized)


def forward_logits(params, cfg, tokens):
  fn = jax.jit(lambda p, t: model.logits(p, model.forward(p, t, cfg), cfg))
  return np.asarray(fn(params, jnp.asarray(tokens, jnp.int32)))


# ----------------------------------------------------------------------- --quantization

@pytest.mark.parametrize('dtype', ('float32', 'bfloat16'))
@pytest.mark.parametrize('fmt', FORMATS)
def test_quantized_forward_equals_the_float_forward_on_dequantized_weights(fmt, dtype):
  cfg = tiny_cfg(dtype=dtype, param_dtype=dtype, tie_embeddings=False)
  params = model.init_params(cfg, jax.random.key(0))
  q = quant.quantize_params(params, fmt)
  for name in LAYER_WEIGHTS:
    assert q['layers'][name].qvalue.dtype == quant.FORMATS[fmt]
  assert not quant.is_quantized(q['embed']) and not quant.is_quantized(q['lm_head'])
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
  got = forward_logits(q, cfg, tokens)
  np.testing.assert_array_equal(got, forward_logits(numpy_dequantized(q, dtype), cfg, tokens))
  # Quantized, not a copy (how far the values are: the next test; the accuracy of a
  # trained model: benchmarks/quantization.py).
  assert np.abs(got - forward_logits(params, cfg, tokens)).max() > 0


@pytest.mark.parametrize('fmt', FORMATS)
def test_values_are_within_half_a_step_of_the_weight_per_output_channel(fmt):
  """int8: |w - q * s| <= s / 2 with s = max|w| / 127.5 over each output channel's inputs
  (qwix's bound: the widest value rounds to the edge of the top step, +-128 clipped to
  127); fp8 e4m3: s = max|w| / 448, within half of fp8's relative step (2^-4) of |w|, or
  of its smallest step."""
  w = np.random.default_rng(1).normal(size=(3, 16, 4, 8)).astype(np.float32)   # [L, D, H, E]
  w[0, :, 1, 2] *= 50   # one channel far wider than the rest keeps its own scale
  q = quant.quantize_params({'layers': {'wq': jnp.asarray(w), **{
      k: jnp.ones((3, 4, 4)) for k in LAYER_WEIGHTS if k != 'wq'}}}, fmt)['layers']['wq']
  assert q.scale.shape == (3, 1, 4, 8)
  values, scale = np.asarray(q.qvalue).astype(np.float32), np.asarray(q.scale)
  bound = 127.5 if fmt == 'int8' else 448
  np.testing.assert_allclose(scale, np.abs(w).max(axis=1, keepdims=True) / bound, rtol=1e-6)
  # Beyond half a step: float32's rounding of w / s and of q * s (2^-24 of |w| each).
  err = np.abs(values * scale - w) - np.abs(w) * 2.0**-23
  if fmt == 'int8':
    assert (err <= scale / 2).all()
  else:
    assert (err <= np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-9)).all()


@pytest.mark.parametrize('fmt', FORMATS)
def test_tensor_parallel_runner_splits_scales_and_computes_the_dequantized_model(fmt):
  """tensor=2: each quantized weight's values and scales split over its output heads
  (or mlp) axis; the paged steps' logits equal the float weights' on the same mesh."""
  cfg = tiny_cfg()
  params = model.init_params(cfg, jax.random.key(1))
  q = quant.quantize_params(params, fmt)
  rng = np.random.default_rng(3)
  prompts = [[int(t) for t in rng.integers(0, 257, n)] for n in PROMPT_LENS]
  runner = tiny_runner(q, cfg, mesh=tensor_mesh())
  got = runner_greedy(runner, prompts, 4)
  want = runner_greedy(tiny_runner(numpy_dequantized(q, cfg.dtype), cfg, mesh=tensor_mesh()),
                       prompts, 4)
  assert got[0] == want[0]
  for rows_got, rows_want in zip(got[1], want[1]):
    np.testing.assert_array_equal(np.stack(rows_got), np.stack(rows_want))
  layer = runner.params['layers'][0]
  assert layer['wq'].qvalue.sharding.spec[1] == 'tensor'
  assert layer['wq'].scale.sharding.spec == layer['wq'].qvalue.sharding.spec
  assert layer['w_gate'].scale.sharding.spec[1] == 'tensor'
  assert layer['w_down'].scale.sharding.spec[0] is None   # [1, D]: the outputs stay whole
  assert layer['wq'].scale.addressable_shards[0].data.shape == (1, cfg.num_heads // 2,
                                                               cfg.resolved_head_dim)


def test_engine_quantizes_at_load_and_says_so(tiny_served, capsys):
  with Engine(tiny_served, ServeConfig(num_blocks=40, max_num_seqs=2, quantization='int8',
                                       max_num_batched_tokens=32)) as eng:
    out = eng.generate([[1, 2, 3]], None)[0]
  assert len(out.token_ids) > 0
  assert 'int8 layer weights, the rest in float32' in capsys.readouterr().out


def test_the_batch_cli_takes_quantization(tiny_workdir, tmp_path):
  from serve import generate   # pylint: disable=import-outside-toplevel
  prompts, output = tmp_path / 'in.jsonl', tmp_path / 'out.jsonl'
  prompts.write_text(json.dumps({'prompt_token_ids': [5, 6, 7], 'max_tokens': 3}) + '\n')
  assert generate.main(['--checkpoint', tiny_workdir, '--prompts', str(prompts),
                        '--output', str(output), '--quantization', 'fp8', '--num-blocks',
                        '40', '--compilation-cache-dir', 'none']) == 0
  assert json.loads(output.read_text())['num_output_tokens'] == 3


# ------------------------------------------------------------------- compressed-tensors

def save_compressed(path, fmt: str, kind: str, symmetric: bool = True,
                    strategy: str = 'channel', num_bits: int = 8):
  """A random tiny transformers Llama, its Linear layers but the head quantized by the
  compressed-tensors library (scales from each row's range, as llm-compressor's minmax
  observer computes them) and saved compressed in `fmt`."""
  # pylint: disable=import-outside-toplevel
  from compressed_tensors.compressors import ModelCompressor
  from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                               QuantizationScheme, apply_quantization_config)
  from compressed_tensors.quantization.utils import calculate_qparams
  config = transformers.LlamaConfig(
      vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
      initializer_range=0.1)
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(config).float().eval()
  args = QuantizationArgs(num_bits=num_bits, type=kind, strategy=strategy, symmetric=symmetric)
  apply_quantization_config(hf, QuantizationConfig(
      config_groups={'group_0': QuantizationScheme(targets=['Linear'], weights=args)},
      ignore=['lm_head'], format=fmt))
  with torch.no_grad():
    for module in hf.modules():
      if hasattr(module, 'weight_scale'):
        w = module.weight
        lo, hi = ((w.amin(1, keepdim=True), w.amax(1, keepdim=True)) if strategy == 'channel'
                  else (w.min().reshape(1), w.max().reshape(1)))
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, 'weight_zero_point'):
          module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
  compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=fmt)
  compressor.compress_model(hf)
  hf.save_pretrained(path)
  compressor.update_config(path)
  write_tokenizer(path)


CHECKPOINTS = {
    'int8_channel': ('int-quantized', 'int', True, 'channel'),
    'int8_asymmetric': ('int-quantized', 'int', False, 'channel'),
    'int8_packed': ('pack-quantized', 'int', True, 'channel'),
    'int8_packed_asymmetric': ('pack-quantized', 'int', False, 'channel'),
    'fp8_channel': ('float-quantized', 'float', True, 'channel'),
    'fp8_tensor': ('float-quantized', 'float', True, 'tensor'),
}


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp('compressed')
  for name, spec in CHECKPOINTS.items():
    save_compressed(str(root / name), *spec)
  return root


# transformers (5.24, compressed-tensors 0.20.1) cannot load a pack-quantized checkpoint
# with zero points (their packed shape mismatches its model's): that one is checked
# against its int-quantized twin instead.
@pytest.mark.parametrize('name', [n for n in CHECKPOINTS if n != 'int8_packed_asymmetric'])
def test_compressed_tensors_checkpoint_gives_transformers_logits(checkpoints, name):
  path = str(checkpoints / name)
  stored = load_file(os.path.join(path, 'model.safetensors'))
  served = load_hf_model(path)
  wq = served.params['layers']['wq']
  assert quant.is_quantized(wq)
  assert wq.qvalue.dtype == (jnp.float8_e4m3fn if 'fp8' in name else jnp.int8)
  assert (wq.zero_point is not None) == name.endswith('asymmetric')
  if 'packed' in name:
    assert 'model.layers.0.self_attn.q_proj.weight_packed' in stored
  tokens = np.random.default_rng(0).integers(0, 300, size=(2, 40))
  got = forward_logits(served.params, served.model_cfg, tokens)
  # Exactly the float model on the dequantized weights.
  np.testing.assert_array_equal(got, forward_logits(numpy_dequantized(served.params, 'float32'),
                                                    served.model_cfg, tokens))
  # transformers, the weights decompressed by the compressed-tensors library.
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    want = hf(torch.as_tensor(tokens)).logits.float().numpy()
  assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()


@pytest.mark.parametrize('packed,twin', [('int8_packed', 'int8_channel'),
                                         ('int8_packed_asymmetric', 'int8_asymmetric')])
def test_packed_weights_read_as_their_unpacked_twin(checkpoints, packed, twin):
  """The same model and scales saved by the library in both formats: equal trees."""
  got, want = (load_hf_model(str(checkpoints / n)).params for n in (packed, twin))
  assert 'model.layers.0.mlp.down_proj.weight_packed' in load_file(
      checkpoints / packed / 'model.safetensors')
  for name in LAYER_WEIGHTS:
    for field in ('qvalue', 'scale', 'zero_point'):
      a, b = getattr(got['layers'][name], field), getattr(want['layers'][name], field)
      assert (a is None) == (b is None) == (field == 'zero_point' and twin == 'int8_channel')
      if a is not None:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_compressed_checkpoint_serves_through_the_engine_on_a_tensor_2_mesh(checkpoints):
  served = load_hf_model(str(checkpoints / 'int8_asymmetric'))
  prompt = [1, 5, 9, 14, 3]
  want = []
  params, cfg = numpy_dequantized(served.params, 'float32'), served.model_cfg
  for _ in range(4):
    want.append(int(forward_logits(params, cfg, [prompt + want])[0, -1].argmax()))
  with Engine(served, ServeConfig(num_blocks=40, max_num_seqs=2, tensor=2,
                                  max_num_batched_tokens=32)) as eng:
    from serve.sampling_params import SamplingParams  # pylint: disable=import-outside-toplevel
    out = eng.generate([prompt], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)])[0]
  assert out.token_ids == want


# ---------------------------------------------------------------------------- bad input

def edited(checkpoints, tmp_path, name, edit=None, drop=()):
  """A copy of checkpoint `name` with config.json's quantization_config edited and the
  tensors `drop` removed."""
  import shutil  # pylint: disable=import-outside-toplevel
  path = tmp_path / f'{name}_edited'
  shutil.copytree(checkpoints / name, path)
  config = json.loads((path / 'config.json').read_text())
  if edit:
    edit(config['quantization_config'])
  (path / 'config.json').write_text(json.dumps(config))
  if drop:
    tensors = load_file(path / 'model.safetensors')
    save_file({k: v for k, v in tensors.items() if k not in drop}, path / 'model.safetensors')
  return str(path)


def _weights(bits=None, **fields):
  def edit(qc):
    qc['config_groups']['group_0']['weights'].update(fields)
  return edit


@pytest.mark.parametrize('edit,message', [
    (_weights(num_bits=4), r'config_groups.group_0.weights.num_bits=4 is not supported: '
                           r'only 8 \(4-bit schemes'),
    (_weights(strategy='group', group_size=128),
     r"weights.strategy='group' is not supported: only channel or tensor"),
    (lambda qc: qc.update(quant_method='awq'), r"quant_method='awq' is not supported"),
    (lambda qc: qc.update(quant_method='gptq'), r"quant_method='gptq' is not supported"),
    (lambda qc: qc.update(quant_method='bitsandbytes'), r"quant_method='bitsandbytes'"),
    (lambda qc: qc['config_groups']['group_0'].update(format='nvfp4-pack-quantized'),
     r"group_0.format='nvfp4-pack-quantized' is not supported: only float-quantized"),
])
def test_unread_quantization_configs_are_refused_before_any_weight_is_read(
    checkpoints, tmp_path, monkeypatch, edit, message):
  path = edited(checkpoints, tmp_path, 'int8_channel', edit)
  monkeypatch.setattr(hf_model, 'read_safetensors',
                      lambda *a: pytest.fail('weights read before the refusal'))
  with pytest.raises(ValueError, match=r'config.json quantization_config.*' + message):
    load_hf_model(path)


def test_a_quantized_tensor_without_its_scale_is_refused_by_name(checkpoints, tmp_path):
  path = edited(checkpoints, tmp_path, 'fp8_channel',
                drop=('model.layers.1.mlp.up_proj.weight_scale',))
  with pytest.raises(ValueError, match=r'^model.layers.1.mlp.up_proj.weight is stored as '
                                       r'float8_e4m3fn but the checkpoint has no '
                                       r'model.layers.1.mlp.up_proj.weight_scale'):
    load_hf_model(path)


def test_fp8_on_a_backend_without_it_is_refused_before_any_weight(checkpoints, tiny_workdir,
                                                                  monkeypatch):
  def no_fp8(device):
    raise RuntimeError('F8E4M3FN is not supported')
  monkeypatch.setattr(quant, '_fp8_probe', no_fp8)
  read = hf_model.read_safetensors
  monkeypatch.setattr(hf_model, 'read_safetensors',
                      lambda *a: pytest.fail('weights read before the refusal'))
  with pytest.raises(ValueError, match=r'^config.json quantization_config \(float8_e4m3fn '
                                       r'weights\): the cpu backend .* cannot convert '
                                       r'float8_e4m3fn .*--quantization int8'):
    load_hf_model(str(checkpoints / 'fp8_channel'))
  from training import checkpoint  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(checkpoint, 'restore_params',
                      lambda *a, **k: pytest.fail('weights read before the refusal'))
  args = config_lib.add_engine_args(__import__('argparse').ArgumentParser()).parse_args(
      ['--checkpoint', tiny_workdir, '--quantization', 'fp8'])
  with pytest.raises(ValueError, match=r'^--quantization=fp8: the cpu backend'):
    config_lib.load_served_model(args)
  monkeypatch.setattr(hf_model, 'read_safetensors', read)
  load_hf_model(str(checkpoints / 'int8_channel'))   # int8 needs no fp8


def test_quantization_flag_mistakes_are_named(checkpoints, tiny_served):
  with pytest.raises(ValueError, match=r"--quantization='int4': choose one of \('none', "
                                       r"'int8', 'fp8'\)"):
    ServeConfig(quantization='int4').validate()
  with pytest.raises(ValueError, match=r'--quantization=int8: .* is already quantized'):
    load_hf_model(str(checkpoints / 'int8_channel'), quantization='int8')
  moe = tiny_served.__class__(**{**tiny_served.__dict__, 'params': None,
                                 'model_cfg': tiny_cfg(num_experts=4, experts_per_token=2)})
  with pytest.raises(ValueError, match=r'--quantization=int8: quantized weights cover dense '
                                       r'models only; this model has 4 experts'):
    with_quantization(moe, 'int8')


# ---------------------------------------------------------------------------- benchmark

def test_quantization_benchmark_refuses_a_run_that_trained_on_its_held_out_windows(
    tiny_workdir):
  from benchmarks import quantization  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit, match='trained with evaluation off: it trained on every'):
    quantization.held_out_windows(tiny_workdir)


def test_quantization_benchmark_counts_agreement_up_to_the_first_difference():
  from benchmarks import quantization  # pylint: disable=import-outside-toplevel
  got = quantization.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
  assert got == {'tokens_before_first_difference': 6, 'of_tokens': 8, 'fraction': 0.75,
                 'identical_requests': 1}


def test_quantization_benchmark_gpu_stage_runs_at_a_tiny_shape(monkeypatch, capsys):
  """gpu_session.sh's quant stage (--shapes=1b) end to end, with the 1B shape swapped for a
  tiny bfloat16 one: what a GPU session runs must not fail on its first try there."""
  # pylint: disable=import-outside-toplevel
  import dataclasses
  from benchmarks import quantization, serve_throughput
  tiny = dataclasses.replace(serve_throughput.SMOKE, dtype='bfloat16')
  monkeypatch.setattr(serve_throughput, 'LLAMA_1B', tiny)
  result = quantization.main(['--shapes=1b', '--smoke', '--kv-cache-dtypes=auto,int8',
                              '--batch=4', '--batch-tokens=64', '--num-prompts=4',
                              '--prompt-chars=8', '--max-tokens=4', '--repeats=1'])
  assert set(result['results']) == {f'{w}/{kv}' for w in quantization.WEIGHTS
                                    for kv in ('auto', 'int8')}
  assert result['model']['dtype'] == 'bfloat16' and result['model']['embed_dim'] == 64
  for row in result['results'].values():
    assert row['perplexity'] is None and row['tokens_per_s'] > 0
    assert row['greedy_agreement']['of_tokens'] == 4 * 4
  assert 'tokens/s' in capsys.readouterr().out
