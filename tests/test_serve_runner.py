"""ModelRunner: greedy decoding of a batch through mixed prefill/decode steps equals argmax
decoding with the training forward, on 1 device and on a tensor=2 mesh; the cache is
donated; compiles stay within the token buckets; KV cache sizing arithmetic. Measured:
sampled logits within 3.2e-6 of the largest |logit| (2.3e-5 absolute) of the dense
forward's over the whole greedy run, and tensor=2 within 3.3e-6 of 1 device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import model
from serve.worker import kv_cache
from serve.worker.model_runner import ModelRunner, RunnerConfig, seq_bucket, token_buckets
from sharding.mesh import MeshConfig, make_mesh
from tests.test_paged_forward import LOGITS_TOL, Chunk, Out, err, tiny_cfg, tiny_runner

PROMPT_LENS = (3, 11, 17, 6)
MAX_NEW = 6
BUDGET = 8   # tokens per step: prompts are prefilled in chunks beside others' decodes


@pytest.fixture(scope='module')
def setup():
  cfg = tiny_cfg()
  params = model.init_params(cfg, jax.random.key(1))
  rng = np.random.default_rng(3)
  prompts = [[int(t) for t in rng.integers(0, 257, n)] for n in PROMPT_LENS]
  return cfg, params, prompts


def dense_greedy(params, cfg, prompt, num_new):
  """Argmax decoding with the training forward, recomputing the whole sequence."""
  fwd = jax.jit(lambda t: model.logits(params, model.forward(params, t, cfg), cfg)[0])
  tokens, rows = list(prompt), []
  for _ in range(num_new):
    buf = np.zeros((1, cfg.max_seq_len), np.int32)   # causal: the zero tail is unseen
    buf[0, :len(tokens)] = tokens
    rows.append(np.asarray(fwd(buf)[len(tokens) - 1]))
    tokens.append(int(rows[-1].argmax()))
  return tokens[len(prompt):], rows


def runner_greedy(runner, prompts, num_new, seed=0):
  """A minimal scheduler: request i arrives at step 2i; each step spends BUDGET tokens
  first come first served (a decode token, or as much of a prompt as fits); blocks are
  drawn from a shuffled pool. Returns each request's tokens and sampled logits rows."""
  bs = runner.cfg.block_size
  pool = [int(b) for b in np.random.default_rng(seed).permutation(runner.cfg.num_blocks)]
  reqs = [dict(tokens=list(p), done=0, blocks=[], out=[], rows=[]) for p in prompts]
  step = 0
  while any(len(r['out']) < num_new for r in reqs):
    chunks, owners, left = [], [], BUDGET
    for r in reqs[:step // 2 + 1]:
      n = min(len(r['tokens']) - r['done'], left)
      if len(r['out']) >= num_new or n == 0:
        continue
      end = r['done'] + n
      while len(r['blocks']) * bs < end:
        r['blocks'].append(pool.pop())
      chunks.append(Chunk(r['tokens'][r['done']:end], r['done'], list(r['blocks']),
                          end == len(r['tokens'])))
      owners.append(r)
      left -= n
      r['done'] = end
    logits = iter(np.asarray(runner.execute(Out(chunks))))
    for r, c in zip(owners, chunks):
      if c.sample:
        r['rows'].append(next(logits))
        r['out'].append(int(r['rows'][-1].argmax()))
        r['tokens'].append(r['out'][-1])
    step += 1
  return [r['out'] for r in reqs], [r['rows'] for r in reqs]


def tensor_mesh():
  return make_mesh(MeshConfig(data=1, tensor=2), jax.devices()[:2])


# ------------------------------------------------------------------------------ greedy

def test_batched_greedy_equals_dense_forward(setup):
  cfg, params, prompts = setup
  runner = tiny_runner(params, cfg)
  tokens, rows = runner_greedy(runner, prompts, MAX_NEW)
  for prompt, got, got_rows in zip(prompts, tokens, rows):
    want, want_rows = dense_greedy(params, cfg, prompt, MAX_NEW)
    assert got == want
    assert max(err(g, w) for g, w in zip(got_rows, want_rows)) < LOGITS_TOL
  assert runner.num_compiles <= len(token_buckets(runner.cfg))


def test_tensor_parallel_equals_one_device(setup):
  """tensor=2: parameters and KV pages split by head; same tokens, logits to ~1e-6."""
  cfg, params, prompts = setup
  one = runner_greedy(tiny_runner(params, cfg), prompts, MAX_NEW)
  runner = tiny_runner(params, cfg, mesh=tensor_mesh())
  two = runner_greedy(runner, prompts, MAX_NEW)
  assert two[0] == one[0]
  for rows_two, rows_one in zip(two[1], one[1]):
    assert max(err(a, b) for a, b in zip(rows_two, rows_one)) < LOGITS_TOL
  assert runner.cache[0].sharding.spec == PartitionSpec(None, None, None, 'tensor', None)
  # The runner holds each layer's weights as its own array (no per-step slice copies).
  assert len(runner.params['layers']) == cfg.num_layers
  assert all(layer['wq'].sharding.spec[1] == 'tensor' for layer in runner.params['layers'])
  assert len(runner.cache[0].addressable_shards) == 2
  assert runner.cache[0].addressable_shards[0].data.shape[3] == cfg.num_kv_heads // 2


def test_tensor_parallel_pallas_step(setup):
  """The kernel run per tensor shard (shard_map over kv heads) agrees with 1 device."""
  cfg, params, prompts = setup
  chunks = [Chunk(prompts[1], 0, [3, 8, 1]), Chunk(prompts[0], 0, [5])]
  want = np.asarray(tiny_runner(params, cfg).execute(Out(chunks)))
  runner = tiny_runner(params, cfg, mesh=tensor_mesh(), attention='pallas')
  assert err(runner.execute(Out(chunks)), want) < LOGITS_TOL


# ----------------------------------------------------------------- compiles, donation

def test_compiles_bounded_by_buckets(setup):
  """50 steps of random ragged shapes compile one program per token bucket."""
  cfg, params, _ = setup
  runner = tiny_runner(params, cfg)
  rng, seen = np.random.default_rng(4), set()
  for _ in range(50):
    lens = rng.integers(1, 9, rng.integers(1, 5))
    starts = rng.integers(0, 30, len(lens))
    chunks = [Chunk([7] * int(n), int(s), list(range(10 * i, 10 * i + 10)), bool(n % 2))
              for i, (n, s) in enumerate(zip(lens, starts))]
    batch, _ = runner.build_batch(chunks)
    seen.add((batch.tokens.shape[0], batch.kv_lens.shape[0]))
    runner.execute(Out(chunks))
  assert runner.num_compiles == len(seen)
  assert 2 <= len(seen) <= len(token_buckets(runner.cfg)) == 3   # 8, 16, 32 tokens


def test_warmup_compiles_every_bucket_and_writes_nothing(setup):
  cfg, params, prompts = setup
  runner = tiny_runner(params, cfg)
  runner.warmup()
  assert runner.num_compiles == len(token_buckets(runner.cfg)) == 3
  assert not any(np.asarray(c).any() for c in runner.cache)
  runner.execute(Out([Chunk(prompts[2], 0, [1, 2, 3, 4, 5])]))
  assert runner.num_compiles == 3


def test_cache_donated(setup):
  cfg, params, prompts = setup
  runner = tiny_runner(params, cfg)
  old = runner.cache
  runner.execute(Out([Chunk(prompts[0], 0, [2])]))
  assert old[0].is_deleted() and old[1].is_deleted()
  assert not runner.cache[0].is_deleted()


def test_xla_step_updates_cache_in_place(setup):
  """Compiled step of a 4096-page cache: the cache is aliased to the output (donated)
  and the step's temporaries stay far below one layer's K pages (no per-layer copy)."""
  cfg, params, _ = setup
  runner = tiny_runner(params, cfg, num_blocks=4096, block_size=16, max_model_len=256)
  batch, _ = runner.build_batch([Chunk([1] * 10, 0, [3])])
  mem = runner._step.lower(runner.params, runner.cache, batch,
                           runner.rope).compile().memory_analysis()
  cache_bytes = sum(c.nbytes for c in runner.cache)
  assert mem.alias_size_in_bytes == cache_bytes
  assert mem.temp_size_in_bytes < cache_bytes / (2 * cfg.num_layers) / 10


def test_buckets():
  rc = RunnerConfig(max_num_seqs=24, max_num_batched_tokens=100)
  assert token_buckets(rc) == [8, 16, 32, 48, 64, 96, 100]
  assert [seq_bucket(rc, t) for t in token_buckets(rc)] == [8, 16, 24, 24, 24, 24, 24]
  rc = RunnerConfig(max_num_seqs=16, max_num_batched_tokens=512)
  assert token_buckets(rc) == [8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512]


@pytest.mark.parametrize('chunks,match', [
    ([Chunk([1] * 5, 0, [0])], 'do not cover'),
    ([Chunk([1], 0, [40])], r'block ids must lie in \[0, 40\)'),
    ([Chunk([1] * 33, 0, list(range(9)))], 'max_num_batched_tokens=32'),
    ([Chunk([1], 0, [i]) for i in range(5)], 'max_num_seqs=4'),
    ([Chunk([1], 64, list(range(17)))], 'max_model_len=64'),
    ([Chunk([], 0, [0])], 'at least one token'),
])
def test_bad_chunks_refused(setup, chunks, match):
  cfg, params, _ = setup
  with pytest.raises(ValueError, match=match):
    tiny_runner(params, cfg).execute(Out(chunks))


def test_bad_config_refused(setup):
  cfg, params, _ = setup
  with pytest.raises(ValueError, match="attention='flash'"):
    tiny_runner(params, cfg, attention='flash')
  mesh = make_mesh(MeshConfig(data=1, tensor=4), jax.devices()[:4])
  with pytest.raises(ValueError, match='model.num_kv_heads divisible by 4'):
    tiny_runner(params, cfg, mesh=mesh)


# ---------------------------------------------------------------------------- sizing

def test_kv_bytes_per_block():
  cfg = tiny_cfg()   # 2 layers, 2 kv heads, head_dim 16, float32
  assert kv_cache.kv_bytes_per_block(cfg, 16) == 2 * 2 * 2 * 16 * 16 * 4
  assert kv_cache.kv_bytes_per_block(tiny_cfg(dtype='bfloat16'), 16) == 2 * 2 * 2 * 16 * 16 * 2
  assert kv_cache.kv_bytes_per_block(cfg, 16, tensor_parallel=2) == 2 * 2 * 1 * 16 * 16 * 4


def test_num_blocks_for_memory():
  cfg, gib = tiny_cfg(), 1 << 30
  got = kv_cache.num_blocks_for_memory(cfg, 16, fraction=0.5, param_bytes=10**8,
                                       memory_bytes=gib)
  assert got == int(0.5 * (gib - 10**8)) // 8192
  with pytest.raises(ValueError, match='no KV cache blocks fit'):
    kv_cache.num_blocks_for_memory(cfg, 16, fraction=0.9, param_bytes=gib, memory_bytes=gib)
  with pytest.raises(ValueError, match='fraction=1.5'):
    kv_cache.num_blocks_for_memory(cfg, 16, fraction=1.5, param_bytes=0)
  # CPU: memory_stats() is None, so the machine's physical memory is used.
  phys = kv_cache.device_memory_bytes(jax.devices('cpu')[0])
  assert phys > 0
  got = kv_cache.num_blocks_for_memory(cfg, 16, fraction=0.1, param_bytes=0,
                                       device=jax.devices('cpu')[0])
  assert got == int(0.1 * phys) // 8192


def test_describe_capacity():
  assert '4.00x concurrency' in kv_cache.describe_capacity(16, 16, 64)
  with pytest.raises(ValueError, match='fewer than one request'):
    kv_cache.describe_capacity(3, 16, 64)


def test_step_greedy_tokens_are_the_argmax_within_the_tokenizer_vocab(setup):
  """The step's own greedy tokens (what an all-greedy engine step uses instead of the
  sampler) are the argmax of the sampled rows over the first vocab_size ids only: the
  model's padded vocabulary past the tokenizer's is never chosen."""
  cfg, params, prompts = setup
  runner = tiny_runner(params, cfg, vocab_size=40)
  chunks = [Chunk(p[:7], 0, list(range(5 * i, 5 * i + 5)), i != 1) for i, p in enumerate(prompts)]
  res = runner.step(Out(chunks))
  logits = np.asarray(res.logits[:res.num_sampled])
  assert res.num_sampled == 3
  np.testing.assert_array_equal(np.asarray(res.greedy)[:3], logits[:, :40].argmax(-1))
  assert (logits.argmax(-1) >= 40).any()   # the cut matters for these rows
