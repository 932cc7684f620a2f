"""Every family model/hf.py reads, end to end against transformers (the independent
implementation): a random *ForCausalLM saved by transformers is served through the paged
forward (prefill in chunks, then greedy decode) with its logits and tokens, fine-tuned
from with init_from_hf (the first step's loss is transformers' loss on the same batch),
and the run exported back to the same architecture, which transformers loads to the run's
logits. The training forward's logits and greedy tokens are tests/test_serve_hf.py's
test_logits_and_greedy_tokens_match_transformers, over the same CASES."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers

import model
from model import paged
from model.config import ModelConfig
from pallas_kernels import paged_attention as pa
from serve import hf_export
from serve.load.checkpoint import load_checkpoint
from serve.load.hf_model import load_hf_model
from tests import flash_cases
from tests.test_paged_attention import MIXED, make_case, rel_err
from tests.test_paged_forward import Chunk, Out, tiny_runner
from tests.test_serve_hf import CASES, our_logits, save_hf, write_tokenizer
from tests.test_train import cache_dir, tiny  # pylint: disable=unused-import
from training import config as train_config, trainer

# One case a family (tests/test_serve_hf.py's CASES).
FAMILY_CASES = ('untied_gqa_sharded', 'mistral_window', 'mixtral_sharded', 'qwen2_tied',
                'qwen3_head_dim', 'qwen3_moe_sparse_step', 'gemma2', 'gemma3')
TOL = 1e-4   # float32 logits, absolute


def hf_logits(hf, tokens) -> np.ndarray:
  with torch.no_grad():
    return hf(torch.as_tensor(np.asarray(tokens)[None])).logits[0].numpy()


@pytest.mark.parametrize('case', FAMILY_CASES)
def test_the_paged_serving_forward_prefills_in_chunks_and_decodes_as_transformers(
    tmp_path, case):
  """A 24-token prompt prefilled in chunks of 5, 7 and 12 tokens, then 8 tokens decoded
  one a step by argmax, all in the paged KV cache: each step's logits equal transformers'
  on the whole sequence at that position, and the tokens equal its greedy generate."""
  hf = save_hf(tmp_path, **CASES[case])
  write_tokenizer(tmp_path)
  served = load_hf_model(str(tmp_path))
  runner = tiny_runner(served.params, served.model_cfg)
  blocks = list(range(16))   # 64 tokens of 4-token blocks
  seq = [int(t) for t in np.random.default_rng(5).integers(0, 300, 24)]
  got, start = [], 0
  for n in (5, 7, 12):
    got.append(np.asarray(runner.execute(Out([Chunk(seq[start:start + n], start, blocks)]))[0]))
    start += n
  for _ in range(8):
    seq.append(int(np.argmax(got[-1])))
    got.append(np.asarray(runner.execute(Out([Chunk(seq[-1:], len(seq) - 1, blocks)]))[0]))
  want = hf_logits(hf, seq[:-1])   # the last token's logits were never asked for
  rows = [4, 11] + list(range(23, len(seq) - 1))
  assert np.abs(np.stack(got[:-1]) - want[rows]).max() < TOL
  assert np.abs(got[-1] - hf_logits(hf, seq)[-1]).max() < TOL
  hf.generation_config.eos_token_id = None   # eight tokens whatever they are
  prompt = torch.as_tensor([seq[:24]])
  with torch.no_grad():   # the mask given: generate takes id 0 in a prompt for padding
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                      do_sample=False, pad_token_id=0)
  assert seq[24:] == out[0, 24:].tolist()


@pytest.mark.parametrize('case', FAMILY_CASES)
def test_a_training_step_from_init_from_hf_and_its_export_match_transformers(
    tmp_path, cache_dir, case):  # pylint: disable=redefined-outer-name
  """init_from_hf on a transformers-saved directory (a byte-level tokenizer): the run's
  first loss is transformers' loss on the run's first batch; `python -m serve.hf_export`
  of the run after that step writes the directory's architecture again, and
  transformers loads it to the logits of the run's checkpoint."""
  released = tmp_path / 'released'
  hf = save_hf(released, **CASES[case])
  (released / 'tokenizer.json').write_text(hf_export.byte_tokenizer_json())
  overrides = dict(init_from_hf=str(released), steps=1, sample__num_tokens=0,
                   optim__warmup_steps=0,   # else the one step's learning rate is 0
                   data__pack_documents=False)   # transformers sees no document boundaries
  if CASES[case].get('family') in ('mixtral', 'qwen3_moe'):
    overrides['model__moe_dispatch'] = 'dropless'   # capacity would drop tokens
  cfg = tiny(tmp_path / 'run', cache_dir, **overrides)
  t = trainer.setup(cfg)
  batch = next(t.data_iter)
  t.data_iter.close()
  first = trainer.train(cfg)[0]
  with torch.no_grad():
    targets = torch.as_tensor(np.asarray(batch['targets'], np.int64))
    want = hf(torch.as_tensor(np.asarray(batch['inputs'], np.int64)), labels=targets,
              shift_labels=targets).loss.item()
  assert first['loss'] == pytest.approx(want, rel=1e-5), (first['loss'], want)

  exported = tmp_path / 'exported'
  assert hf_export.main(['--checkpoint', str(tmp_path / 'run'), '--output',
                         str(exported)]) == 0
  config = json.loads((exported / 'config.json').read_text())
  assert config['architectures'] == hf.config.architectures
  back = transformers.AutoModelForCausalLM.from_pretrained(str(exported),
                                                           dtype=torch.float32).eval()
  assert type(back) is type(hf)
  run = load_checkpoint(str(tmp_path / 'run'), dtype='float32')
  ids = np.random.default_rng(6).integers(0, 300, size=(2, 40))
  with torch.no_grad():
    theirs = back(torch.as_tensor(ids)).logits.numpy()
  ours = our_logits(run, ids)
  assert np.abs(theirs - ours).max() < TOL
  assert np.abs(theirs - hf(torch.as_tensor(ids)).logits.detach().numpy()).max() > 1e-3, (
      'the step changed no logit: the export would pass on the released weights')
  assert os.path.isfile(exported / 'tokenizer.json')


@pytest.mark.parametrize('layout', ['fsdp2_tp4', 'tp4_sp_dp2'])
def test_biases_and_head_norms_train_alike_on_every_layout(layout, monkeypatch):
  """qkv_bias and qk_norm (random, not their zeros and ones) under FSDP with tensor
  parallelism and under sequence parallelism: the loss and every gradient equal one
  device's (tests/test_parallel.py's layouts)."""
  from tests import test_parallel  # pylint: disable=import-outside-toplevel
  cfg = test_parallel.tiny_config()
  cfg.model = dataclasses.replace(cfg.model, qkv_bias=True, qk_norm=True)
  init = model.init_params

  def random_extras(model_cfg, key):
    params = init(model_cfg, key)
    rng = np.random.default_rng(0)
    for name in ('bq', 'bk', 'bv', 'q_norm', 'k_norm'):
      w = params['layers'][name]
      params['layers'][name] = w + 0.5 * rng.standard_normal(w.shape).astype(w.dtype)
    return params

  monkeypatch.setattr(model, 'init_params', random_extras)
  ref_loss, ref_grads = test_parallel.sharded_loss_and_grads(
      cfg, test_parallel.MeshConfig(data=1), 0, False, jax.devices()[:1])
  loss, grads = test_parallel.sharded_loss_and_grads(cfg, *test_parallel.PRESETS[layout])
  assert test_parallel.rel_err(loss, ref_loss) < 1e-5
  errs = jax.tree.map(test_parallel.rel_err, grads, ref_grads)
  assert max(jax.tree.leaves(errs)) < 1e-5, errs
  assert all(np.any(np.asarray(grads['layers'][name]))
             for name in ('bq', 'bk', 'bv', 'q_norm', 'k_norm'))


@pytest.mark.parametrize('kw', [dict(block_k=4), dict(block_k=4, row_tokens=10**6),
                                dict(block_k=4, step_dense=True), dict(block_k=8, window=4)],
                         ids=['by_sequence', 'by_row', 'step_dense', 'windows_of_4'])
def test_the_xla_paged_attention_keeps_to_the_sliding_window(kw):
  """model.sliding_window in serving: every path of the XLA paged attention equals the
  reference with the window (each row its last 3 or 7 positions), which differs from
  attention over the whole context."""
  split = [(1, 9), (5, 13), (12, 12), (1, 1), (7, 7)]   # step_dense's split path applies
  for seqs in (MIXED, split):
    case = make_case(seqs, hq=8, hkv=2, max_seqs=7, seed=3)
    live = case.live_rows
    for window in (3, 7):
      want = pa.paged_attention_reference(*case.args, sliding_window=window)[:live]
      got = pa.paged_attention_xla(*case.args, sliding_window=window, **kw)[:live]
      assert rel_err(got, want) < 1e-5, (window, rel_err(got, want))
      assert rel_err(pa.paged_attention_reference(*case.args)[:live], want) > 0.1


def test_sliding_window_is_refused_where_it_is_not_computed():
  """cuDNN and context parallelism, which attend the whole context, are refused by name
  at start; both paged attentions (XLA and the Pallas kernel) compute the window."""
  with pytest.raises(ValueError, match="sliding_window=8 runs with attention_impl xla or "
                                       "pallas \\(it is 'cudnn'\\)"):
    ModelConfig(sliding_window=8, attention_impl='cudnn').validate()
  for impl in ('xla', 'pallas'):
    paged.check_impl(ModelConfig(sliding_window=8), impl)
  with pytest.raises(ValueError, match="paged attention 'cuda' is unknown"):
    paged.check_impl(ModelConfig(sliding_window=8), 'cuda')
  cfg = train_config.Config()
  cfg.model.sliding_window, cfg.mesh.context, cfg.mesh.data = 8, 2, 4
  with pytest.raises(ValueError, match='mesh.context=2 with model.sliding_window=8'):
    train_config.validate(cfg, 8)


def test_serving_a_windowed_model_takes_pallas_on_a_gpu(tmp_path, monkeypatch):
  """--attention auto serves a sliding-window model with the Pallas paged kernel on a GPU,
  as any other model, and with XLA's on CPU; the loader's check passes --attention pallas."""
  import argparse  # pylint: disable=import-outside-toplevel
  from serve import config as serve_config  # pylint: disable=import-outside-toplevel
  path = tmp_path / 'mistral'
  save_hf(path, **CASES['mistral_window'])
  parse = lambda *flags: serve_config.add_engine_args(argparse.ArgumentParser()).parse_args(
      ['--hf-model', str(path), *flags])
  window = ModelConfig(sliding_window=8)
  assert serve_config.resolve_attention(parse(), window) == 'xla'   # CPU
  pallas = parse('--attention', 'pallas')
  paged.check_impl(window, serve_config.resolve_attention(pallas, window))   # as the loader
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert serve_config.resolve_attention(parse(), window) == 'pallas'
  assert serve_config.resolve_attention(parse(), ModelConfig()) == 'pallas'


def test_the_flash_kernel_keeps_to_the_same_sliding_window():
  """attention_impl=pallas (the flash kernels, interpreted on CPU) with model.sliding_window:
  the loss and gradients of the XLA attention's window, not the whole context's."""
  cfg = flash_cases.tiny_config(sliding_window=5)
  loss_and_grads = flash_cases.loss_and_grads_of(cfg, model.init_params(cfg, jax.random.key(0)))
  want = flash_cases.assert_flash_equals_xla(loss_and_grads)
  assert rel_err(loss_and_grads(sliding_window=0)[0], want) > 1e-3
