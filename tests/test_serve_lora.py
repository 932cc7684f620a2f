"""Serving LoRA adapters (vLLM's multi-LoRA): PEFT adapters of a random tiny Llama,
served by name through the engine and the HTTP server, against transformers + peft with
the adapter merged into the weights (the independent reference)."""

import json
import re
import threading
import time

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


def greedy():
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


# ----------------------------------------------------------------------- over HTTP

@pytest.fixture(scope='module')
def server(lora_dirs):
  """An engine with two slots and one adapter loaded, behind the API key."""
  base, dirs, _ = lora_dirs
  e = make_engine(base, {'all8': dirs['all8']}, max_loras=2)
  srv = ServerThread(create_app(e, e.served, api_key='sesame', model_name='base'))
  yield srv, e
  srv.stop()
  e.shutdown()


def post(srv, path, body):
  return httpx.post(srv.url + path, json=body, timeout=120,
                    headers={'Authorization': 'Bearer sesame'})


def complete(srv, model, prompt, max_tokens=MAX_TOKENS):
  resp = post(srv, '/v1/completions', {'model': model, 'prompt': prompt, 'max_tokens': max_tokens,
                                        'temperature': 0, 'ignore_eos': True})
  assert resp.status_code == 200, resp.text
  return resp.json()['choices'][0]


def stream_tokens(srv, model, prompt, max_tokens, out: list):
  """Streams a completion, appending each chunk's text to out (in a thread)."""
  with httpx.stream('POST', srv.url + '/v1/completions', timeout=120,
                    headers={'Authorization': 'Bearer sesame'},
                    json={'model': model, 'prompt': prompt, 'max_tokens': max_tokens,
                          'temperature': 0, 'ignore_eos': True, 'stream': True}) as r:
    for line in r.iter_lines():
      if line.startswith('data: ') and line != 'data: [DONE]':
        out.append(json.loads(line[6:]))


def text_of(lora_dirs, adapter, prompt, n=MAX_TOKENS):
  """The reference's greedy text as the server writes it (special tokens skipped)."""
  tokens = reference(lora_dirs[2][adapter], prompt, n)[0]
  return ''.join(f' w{t - len(SPECIALS)}' for t in tokens if t >= len(SPECIALS))


def leak_free(engine):
  """No request tracked or holding an adapter, every KV block free; no slot claimed,
  only loaded adapters in slots, no unloaded adapter's host arrays kept."""
  assert engine.num_unfinished == 0
  assert engine.lora.num_running() == 0
  assert engine.scheduler.kv_cache_usage == 0.0
  # pylint: disable=protected-access
  lora = engine.lora
  loaded = {entry.adapter_id for entry in lora._by_name.values()}
  assert lora.table._claims == {}
  assert set(lora.table.resident()) <= loaded and set(lora._by_id) == loaded


def test_models_list_the_base_and_its_adapters_with_their_parent(server):
  srv, _ = server
  resp = httpx.get(srv.url + '/v1/models', headers={'Authorization': 'Bearer sesame'})
  cards = {c['id']: c for c in resp.json()['data']}
  assert set(cards) == {'base', 'all8'} and cards['all8']['parent'] == 'base'
  assert httpx.post(srv.url + '/v1/load_lora_adapter', json={}).status_code == 401


def test_responses_name_the_adapter_the_request_named(server):
  """As vLLM: "model" is the adapter's name in completions, chat and every streamed
  chunk, and the base's for the base."""
  srv, engine = server
  for model in ('all8', 'base'):
    for path, extra in (('/v1/completions', {'prompt': 'w1 w2'}),
                        ('/v1/chat/completions', {'messages': [{'role': 'user',
                                                                'content': 'w1'}]})):
      body = {'model': model, 'max_tokens': 3, **extra}
      resp = post(srv, path, body)
      assert resp.status_code == 200 and resp.json()['model'] == model, resp.text
      with httpx.stream('POST', srv.url + path, json={**body, 'stream': True}, timeout=120,
                        headers={'Authorization': 'Bearer sesame'}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith('data: ') and line != 'data: [DONE]']
      assert chunks and {c['model'] for c in chunks} == {model}, chunks
  leak_free(engine)
  metrics = httpx.get(srv.url + '/metrics').text
  assert re.search(r'meshlm:lora_requests_info\{max_lora="2",running_lora_adapters="",'
                   r'waiting_lora_adapters=""\} \d', metrics), metrics
  assert 'meshlm:lora_adapters_loaded 1.0' in metrics


def test_load_serve_unload_reload_while_others_stream(lora_dirs, server):
  """A base request streams throughout; an adapter is loaded, serves its merged
  weights' tokens, is unloaded while a request on it runs (which finishes with its
  tokens), is refused by name after, and is reloaded; no step recompiles for any of it,
  and nothing leaks."""
  srv, engine = server
  _, dirs, _ = lora_dirs
  prompt = PROMPTS[0]
  complete(srv, 'all8', prompt)   # compiles the buckets these requests use
  complete(srv, 'base', prompt)
  compiles = engine.runner.num_compiles
  background = []
  bg = threading.Thread(target=stream_tokens, args=(srv, 'base', prompt, 60, background))
  bg.start()
  assert post(srv, '/v1/load_lora_adapter',
              {'lora_name': 'attn4', 'lora_path': str(dirs['attn4'])}).status_code == 200
  assert complete(srv, 'attn4', prompt)['text'] == text_of(lora_dirs, 'attn4', prompt)
  running = []
  fg = threading.Thread(target=stream_tokens, args=(srv, 'attn4', prompt, 100, running))
  fg.start()
  while not running:
    time.sleep(0.01)
  with engine._lock:   # pylint: disable=protected-access  # no step ends it meanwhile
    resp = post(srv, '/v1/unload_lora_adapter', {'lora_name': 'attn4'})
  assert resp.status_code == 200 and 'finish first' in resp.text, resp.text
  gone = post(srv, '/v1/completions', {'model': 'attn4', 'prompt': prompt, 'max_tokens': 2})
  assert gone.status_code == 404 and gone.json()['error']['code'] == 'model_not_found'
  fg.join()
  text = ''.join(c['choices'][0]['text'] for c in running)
  assert text == text_of(lora_dirs, 'attn4', prompt, 100)   # all on its adapter
  assert post(srv, '/v1/load_lora_adapter',
              {'lora_name': 'attn4', 'lora_path': str(dirs['attn4'])}).status_code == 200
  assert complete(srv, 'attn4', prompt)['text'] == text_of(lora_dirs, 'attn4', prompt)
  bg.join()
  assert ''.join(c['choices'][0]['text'] for c in background).startswith(
      text_of(lora_dirs, 'base', prompt))
  assert engine.runner.num_compiles == compiles
  assert post(srv, '/v1/unload_lora_adapter', {'lora_name': 'attn4'}).status_code == 200
  leak_free(engine)


@pytest.fixture(scope='module')
def bad_dirs(lora_dirs, tmp_path_factory):
  """Adapters this server must refuse, each for one reason."""
  base, _, _ = lora_dirs
  root = tmp_path_factory.mktemp('bad_lora')
  out = {}
  out['rank16'] = root / 'rank16'
  save_adapter(str(base), out['rank16'], 16, 16, ['q_proj'], False, seed=5)
  out['lm_head'] = root / 'lm_head'
  save_adapter(str(base), out['lm_head'], 4, 8, ['lm_head'], False, seed=6)
  # Another base: wider (its shapes do not fit), and one of the same shapes but another
  # vocabulary (only its config.json tells).
  for name, kw in (('wide', {'hidden_size': 96}), ('other_vocab', {'vocab_size': 300})):
    other = root / f'{name}_base'
    save_llama(other, **kw)
    out[name] = root / name
    save_adapter(str(other), out[name], 4, 8, ['q_proj', 'v_proj'], False, seed=7)
  # The wide one without its base's name: its shapes alone refuse it.
  conf = json.loads((out['wide'] / 'adapter_config.json').read_text())
  conf['base_model_name_or_path'] = None
  (out['wide'] / 'adapter_config.json').write_text(json.dumps(conf))
  return out


@pytest.mark.parametrize('case, status, message', [
    ('rank16', 400, r"rank 16 exceeds --max-lora-rank=8; restart with --max-lora-rank 16"),
    ('lm_head', 400,
     r"tensor 'base_model.model.lm_head.\S+' is not a LoRA weight of a Llama-family projection"),
    ('wide', 400, r"this base needs \(4, 64\) \(rank 4\): the adapter was trained on another"),
    ('other_vocab', 400, r"whose vocab_size=300 differs from the served model's 208"),
    ('missing', 400, r"not a PEFT adapter directory"),
])
def test_adapters_that_do_not_fit_are_refused_in_one_line(lora_dirs, bad_dirs, server, case,
                                                         status, message):
  srv, engine = server
  path = bad_dirs.get(case, '/nonexistent/adapter')
  resp = post(srv, '/v1/load_lora_adapter', {'lora_name': case, 'lora_path': str(path)})
  err = resp.json()['error']
  assert resp.status_code == status and '\n' not in err['message'], resp.text
  assert re.search(message, err['message']), err['message']
  assert complete(srv, 'all8', PROMPTS[0])['text'] == text_of(lora_dirs, 'all8', PROMPTS[0])
  assert [c['id'] for c in httpx.get(srv.url + '/v1/models', headers={
      'Authorization': 'Bearer sesame'}).json()['data']] == ['base', 'all8']
  leak_free(engine)


def test_unknown_names_and_a_full_house_are_refused_and_the_server_goes_on(lora_dirs, server):
  """A request naming no served model: 404 in OpenAI's shape, code model_not_found (as
  vLLM); unloading an unknown adapter: 404; a load past --max-cpu-loras (--max-loras
  by default): 400 naming the adapters loaded. The server serves on, nothing leaked."""
  srv, engine = server
  _, dirs, _ = lora_dirs
  for path in ('/v1/completions', '/v1/chat/completions'):
    body = {'model': 'nope', 'max_tokens': 2, 'prompt': 'w1',
            'messages': [{'role': 'user', 'content': 'w1'}]}
    resp = post(srv, path, body)
    assert resp.status_code == 404, resp.text
    assert resp.json() == {'error': {
        'message': "The model 'nope' does not exist: this server serves 'base' and the LoRA "
                   "adapters ['all8'] (GET /v1/models lists them).",
        'type': 'NotFoundError', 'param': 'model', 'code': 'model_not_found'}}
  resp = post(srv, '/v1/unload_lora_adapter', {'lora_name': 'nope'})
  assert resp.status_code == 404 and resp.json()['error']['code'] == 'model_not_found'
  assert post(srv, '/v1/load_lora_adapter',
              {'lora_name': 'attn4', 'lora_path': str(dirs['attn4'])}).status_code == 200
  resp = post(srv, '/v1/load_lora_adapter', {'lora_name': 'mlp2', 'lora_path': str(dirs['mlp2'])})
  assert resp.status_code == 400, resp.text
  assert '--max-cpu-loras=2 adapters are loaded (all8, attn4); unload one first' in (
      resp.json()['error']['message'])
  resp = post(srv, '/v1/load_lora_adapter', {'lora_name': 'base', 'lora_path': str(dirs['mlp2'])})
  assert resp.status_code == 400 and "other than the base model's" in resp.text
  assert complete(srv, 'attn4', PROMPTS[0])['text'] == text_of(lora_dirs, 'attn4', PROMPTS[0])
  assert post(srv, '/v1/unload_lora_adapter', {'lora_name': 'attn4'}).status_code == 200
  leak_free(engine)


@pytest.mark.parametrize('kw, message', [
    ({'lora_modules': ('a=x',)}, 'need --enable-lora'),
    ({'enable_lora': True, 'max_loras': 1, 'lora_modules': ('a=x', 'b=y')},
     'names 2 adapters, more than --max-cpu-loras=1'),
    ({'enable_lora': True, 'lora_modules': ('a',)}, "give NAME=DIR"),
    ({'enable_lora': True, 'max_lora_rank': 0}, '--max-lora-rank=0: must be at least 1'),
])
def test_bad_lora_flags_are_refused_at_start(kw, message):
  with pytest.raises(ValueError, match=message):
    ServeConfig(**kw).validate()


def test_an_adapter_too_large_for_the_flags_stops_the_start_in_one_line(lora_dirs, bad_dirs,
                                                                        capsys):
  from serve import __main__ as serve_main  # pylint: disable=import-outside-toplevel
  base, _, _ = lora_dirs
  code = serve_main.main(['--hf-model', str(base), '--enable-lora', '--max-lora-rank', '8',
                          '--lora-modules', f'big={bad_dirs["rank16"]}', '--num-blocks', '16'])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert code == 2
  assert err.startswith("error: LoRA adapter 'big'") and 'exceeds --max-lora-rank=8' in err, err
