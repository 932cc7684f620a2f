"""Serving LoRA adapters (vLLM's multi-LoRA): PEFT adapters of a random tiny Llama,
served by name through the engine and the HTTP server, against transformers + peft with
the adapter merged into the weights (the independent reference)."""

import dataclasses
import json
import os
import shutil
import threading

import httpx
import numpy as np
import pytest
import torch

peft = pytest.importorskip('peft')
transformers = pytest.importorskip('transformers')

from serve.api.server import create_app  # noqa: E402
from serve.config import ServeConfig  # noqa: E402
from serve.engine.core import Engine  # noqa: E402
from serve.load.hf_model import load_hf_model  # noqa: E402
from serve.sampling_params import SamplingParams  # noqa: E402
from tests.test_serve_hf import SPECIALS, WORDS, save_llama, write_tokenizer  # noqa: E402
from tests.test_serve_server import ServerThread  # noqa: E402

ALL = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
# name -> (rank, alpha, target modules, rslora)
ADAPTERS = {'all8': (8, 16, ALL, False), 'attn4': (4, 8, ['q_proj', 'v_proj'], False),
            'mlp2': (2, 5, ['gate_proj', 'up_proj', 'down_proj'], True)}
PROMPTS = [[5, 17, 33, 8, 120, 44, 9], [70, 30, 30, 81, 200, 16, 150, 42, 11, 23, 64, 7,
                                           19, 88, 31, 140, 55, 12, 99, 10, 6, 73, 18]]
MAX_TOKENS = 8
VOCAB = len(SPECIALS + WORDS)   # the tokenizer's ids (odd)


def save_adapter(base_dir, path, rank, alpha, targets, rslora, seed):
  """A PEFT LoRA on the base with random nonzero A and B, saved to path; returns
  transformers' model with it merged into the weights."""
  torch.manual_seed(seed)
  base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).float().eval()
  config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                           use_rslora=rslora, lora_dropout=0.0)
  model = peft.get_peft_model(base, config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'lora_' in name:
        p.normal_(0.0, 0.3)
  model.save_pretrained(path)
  return model.merge_and_unload().eval()


@pytest.fixture(scope='module')
def lora_dirs(tmp_path_factory):
  """The base directory, {name: adapter dir} and {name: merged transformers model}."""
  root = tmp_path_factory.mktemp('lora')
  base = root / 'base'
  save_llama(base, vocab_size=VOCAB + 1)   # even, for tensor=2; the engine samples VOCAB
  write_tokenizer(base)
  dirs, merged = {}, {}
  for i, (name, spec) in enumerate(ADAPTERS.items()):
    dirs[name] = root / name
    merged[name] = save_adapter(str(base), dirs[name], *spec, seed=i + 1)
  merged['base'] = transformers.AutoModelForCausalLM.from_pretrained(str(base)).float().eval()
  return base, dirs, merged


def make_engine(base, dirs, **kw):
  served = load_hf_model(str(base))
  cfg = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
             enable_lora=True, max_loras=4, max_lora_rank=8,
             lora_modules=tuple(f'{n}={d}' for n, d in dirs.items()))
  return Engine(served, ServeConfig(**{**cfg, **kw}))


@pytest.fixture(scope='module')
def engine(lora_dirs):
  base, dirs, _ = lora_dirs
  e = make_engine(base, dirs)
  yield e
  e.shutdown()


def reference(model, prompt, n=MAX_TOKENS):
  """Greedy tokens and their log-probabilities by transformers (float32)."""
  ids, logps = list(prompt), []
  with torch.no_grad():
    for _ in range(n):
      logits = model(torch.as_tensor([ids])).logits[0, -1, :VOCAB].double()
      lp = torch.log_softmax(logits, -1)
      tok = int(torch.argmax(lp))
      ids.append(tok)
      logps.append(float(lp[tok]))
  return ids[len(prompt):], logps


def greedy(adapter=None):
  return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)


def run(engine, prompt, adapter):
  stream = engine.add_request(prompt, greedy(), lora=None if adapter == 'base' else adapter)
  res = stream.result()
  assert res.error is None, res.error
  return res.token_ids, [lp.logprob for lp in res.logprobs]


def check_equal(got, want):
  tokens, logps = got
  assert tokens == want[0]
  np.testing.assert_allclose(logps, want[1], rtol=0, atol=2e-4)


@pytest.mark.parametrize('adapter', [*ADAPTERS, 'base'])
def test_an_adapter_serves_what_its_merged_weights_give(lora_dirs, engine, adapter):
  """Each adapter alone (and the base) against transformers with the adapter merged:
  greedy tokens equal, log-probabilities to float32 tolerance."""
  merged = lora_dirs[2]
  for prompt in PROMPTS:
    check_equal(run(engine, prompt, adapter), reference(merged[adapter], prompt))


def test_a_batch_mixing_three_adapters_and_the_base_gives_each_what_it_gets_alone(
    lora_dirs, engine):
  """Every request is admitted before the next schedule (the engine's lock held), so
  the adapters' and the base's rows share steps; each equals transformers on its merged
  weights, as alone."""
  merged = lora_dirs[2]
  jobs = [(p, a) for p in PROMPTS for a in [*ADAPTERS, 'base']]
  with engine._lock:   # pylint: disable=protected-access
    streams = [engine.add_request(p, greedy(), lora=None if a == 'base' else a)
               for p, a in jobs]
  for (p, a), s in zip(jobs, streams):
    res = s.result()
    check_equal((res.token_ids, [lp.logprob for lp in res.logprobs]), reference(merged[a], p))


def test_the_prefix_cache_is_never_shared_across_adapters(lora_dirs, engine):
  """One prompt of several full blocks under two adapters and the base: none reuses
  another's blocks (each its own reference's output); the same adapter again does."""
  merged = lora_dirs[2]
  prompt = [int(t) for t in np.random.default_rng(7).integers(7, 200, 21)]
  hits = []
  for a in ('all8', 'attn4', 'base', 'attn4'):
    before = engine.stats().prefix_cache_hits
    check_equal(run(engine, prompt, a), reference(merged[a], prompt))
    hits.append(engine.stats().prefix_cache_hits - before)
  assert hits[:3] == [0, 0, 0] and hits[3] >= 16, hits


def test_tensor_parallel_adapters_serve_what_one_device_does(lora_dirs):
  """On a tensor=2 mesh the slot arrays split like their base weights; a mixed batch
  still equals transformers on the merged weights."""
  base, dirs, merged = lora_dirs
  e = make_engine(base, dirs, tensor=2)
  try:
    spec = lambda t, half: tuple(e.runner.lora.arrays[t][half].sharding.spec)  # noqa: E731
    # B split on the output of q (like wq's heads), A on the input of o (like wo's).
    assert spec('q', 'b')[3] == 'tensor' and spec('o', 'a')[2] == 'tensor', (spec('q', 'b'),
                                                                            spec('o', 'a'))
    jobs = [(PROMPTS[1], a) for a in [*ADAPTERS, 'base']]
    with e._lock:   # pylint: disable=protected-access
      streams = [e.add_request(p, greedy(), lora=None if a == 'base' else a) for p, a in jobs]
    for (p, a), s in zip(jobs, streams):
      res = s.result()
      check_equal((res.token_ids, [lp.logprob for lp in res.logprobs]),
                  reference(merged[a], p))
  finally:
    e.shutdown()
