"""ModelRunner: one jitted ragged step over a scheduler's output, the KV cache in place.

The scheduler's chunks (decode tokens and prefill chunks, mixed) become one flat batch
(model.paged.PagedBatch) padded to bucketed sizes: the token count T to the next of
token_buckets (powers of two and 1.5x steps between them, at least MIN_TOKEN_BUCKET, at
most max_num_batched_tokens), and the sequence slots to min(T, max_num_seqs), enough
for any step of T tokens. So the sequence bucket follows the token bucket and a long run
compiles one program per token bucket (8, 16, 32, 48, ..., 512: 11 for the defaults),
not one per step. Dead sequence slots cost nothing that grows with
the context: the XLA attention never loops over them and the kernel's programs for them
exit at once. The cache is donated to the step, so its buffers are reused in place;
only the sampled chunks' last rows reach the vocabulary projection (with speculative
decoding, a chunk's draft rows and the row before them: sample_bucket rows a step).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from model import kv_quant, paged, quant
from serve.worker.lora_slots import LoraSlots
from model.config import ModelConfig
from model.transformer import abstract_params, logical_axes, logits as model_logits
from sharding.rules import REPLICATED, ShardingPlan, activation_rules, check_divisible

ATTENTION = ('xla', 'pallas')
MIN_TOKEN_BUCKET = 8
MID_BUCKETS_FROM = 32
_FIELD_OF_AXIS = {'vocab': 'model.vocab_size', 'heads': 'model.num_heads',
                  'kv_heads': 'model.num_kv_heads', 'mlp': 'model.mlp_dim'}


@dataclasses.dataclass
class RunnerConfig:
  block_size: int = 16
  num_blocks: int = 256
  max_num_seqs: int = 32
  max_num_batched_tokens: int = 512
  max_model_len: int = 2048
  attention: str | None = None   # 'xla' | 'pallas'; None: 'pallas' on GPU, else 'xla'
  # Draft tokens a chunk may carry, each a sampled row. A step's program returns
  # sample_bucket rows whether or not it carries drafts (the head then runs on padding
  # rows too: one program per token bucket still).
  num_speculative_tokens: int = 0
  # LoRA adapters resident at once (slot arrays of this many slots plus the base's), and
  # the rank they are padded to; 0: no adapters (the step takes none).
  max_loras: int = 0
  max_lora_rank: int = 0
  # The cache's storage (model.kv_quant): 'auto' (the model's dtype), or 8-bit with scales.
  kv_cache_dtype: str = 'auto'

  @property
  def resolved_attention(self) -> str:
    if self.attention is not None:
      return self.attention
    return 'pallas' if jax.default_backend() == 'gpu' else 'xla'

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_model_len // self.block_size)

  def validate(self) -> None:
    if self.resolved_attention not in ATTENTION:
      raise ValueError(f'runner attention={self.attention!r}: choose one of {ATTENTION}.')
    for name in ('block_size', 'num_blocks', 'max_num_seqs', 'max_num_batched_tokens',
                 'max_model_len'):
      if getattr(self, name) <= 0:
        raise ValueError(f'runner {name}={getattr(self, name)} must be positive.')
    kv_quant.check_name(self.kv_cache_dtype)
    if self.num_speculative_tokens < 0:
      raise ValueError(f'runner num_speculative_tokens={self.num_speculative_tokens} must '
                       'be 0 (off) or positive.')
    if self.max_num_batched_tokens < self.max_num_seqs:
      raise ValueError(f'runner max_num_batched_tokens={self.max_num_batched_tokens} is '
                       f'below max_num_seqs={self.max_num_seqs}: every running sequence '
                       'needs a token per step; raise max_num_batched_tokens.')


def token_buckets(cfg: RunnerConfig) -> list[int]:
  """Powers of two from MIN_TOKEN_BUCKET, with 1.5x steps between them from
  MID_BUCKETS_FROM on, capped at max_num_batched_tokens. A step costs about its bucket
  (padding rows run the whole layer stack), and prefill-carrying steps land anywhere in
  between: the midpoints cut their padding about in half (8, 16, 32, 48, ..., 384, 512:
  11 programs for the defaults)."""
  out, n = [], MIN_TOKEN_BUCKET
  while n < cfg.max_num_batched_tokens:
    out.append(n)
    mid = n * 3 // 2
    if n >= MID_BUCKETS_FROM and mid < cfg.max_num_batched_tokens:
      out.append(mid)
    n *= 2
  return out + [cfg.max_num_batched_tokens]


def seq_bucket(cfg: RunnerConfig, token_bucket: int) -> int:
  """Sequence slots of a step with `token_bucket` tokens: each chunk has a token."""
  return min(token_bucket, cfg.max_num_seqs)


def sample_bucket(cfg: RunnerConfig, token_bucket: int) -> int:
  """Rows whose logits a step of `token_bucket` tokens returns: one per sequence slot,
  and with speculative decoding one more per draft token a chunk may carry."""
  return min(token_bucket, seq_bucket(cfg, token_bucket) * (1 + cfg.num_speculative_tokens))


def _bucket(n: int, buckets: list[int]) -> int:
  return next(b for b in buckets if b >= n)


def serving_plan(mesh) -> ShardingPlan | None:
  """Tensor parallelism only: parameters by the tensor rules, activations whole except
  heads, kv heads, mlp and vocab; other mesh axes just hold replicas."""
  if mesh is None:
    return None
  acts = activation_rules(False).with_overrides('serve_activations', batch=None, seq=None,
                                                act_seq=None)
  # MoE experts stay whole on each device (their mlp dimension splits over tensor).
  params = REPLICATED.with_overrides('serve_params', experts=None)
  return ShardingPlan(mesh, params, params, params, acts)


SCORE_ROWS = 256   # rows whose full-vocabulary logits a scored step holds at once


class StepResult(NamedTuple):
  """One step's sampled rows, on the device: logits [R, vocab] (R = sample_bucket; rows
  past num_sampled are padding; a chunk with a draft has a row per draft token after
  its last known token's) and each row's greedy token [R] (argmax over the first
  `vocab_size` ids, as the sampler's greedy rows take it), so an all-greedy step needs no
  sampler. With
  targets (`step`), `scores` is (log p of each token's target [T], its rank [T] (the
  tokens at least as likely, itself included, as vLLM counts), and the top_n (log p [T, n], ids [T, n]) or None) over the batch's
  token rows."""
  logits: jax.Array
  greedy: jax.Array
  num_sampled: int
  scores: tuple | None = None


class ModelRunner:
  """Runs scheduler outputs through the paged forward; owns the KV cache.

  vocab_size: ids the greedy tokens are chosen among (the tokenizer's; default the
  model's vocabulary, which may be padded past it)."""

  def __init__(self, params, model_cfg: ModelConfig, runner_cfg: RunnerConfig, mesh=None,
               vocab_size: int | None = None):
    runner_cfg.validate()
    self.model_cfg, self.cfg = model_cfg, runner_cfg
    self.vocab_size = vocab_size or model_cfg.vocab_size
    self.plan = serving_plan(mesh)
    self.impl = runner_cfg.resolved_attention
    paged.check_impl(model_cfg, self.impl)   # before any weight is placed
    self._tokens = token_buckets(runner_cfg)
    self.params, cache_sharding = self._place(params)
    self._cache_sharding = cache_sharding
    self.lora = None   # lora_slots.LoraSlots with max_loras
    if runner_cfg.max_loras:
      self.lora = LoraSlots(model_cfg, runner_cfg.max_loras, runner_cfg.max_lora_rank,
                            self.plan)
    self.cache = self._empty_cache()
    self.rope = paged.rope_table(model_cfg, runner_cfg.max_model_len)
    if self.plan is not None:
      self.rope = jax.device_put(self.rope, NamedSharding(mesh, PartitionSpec()))
    out_sh = None
    if self.plan is not None:   # logits gathered whole for the sampler
      whole = NamedSharding(mesh, PartitionSpec())
      out_sh = (whole, whole, cache_sharding)
    self._step = jax.jit(self._run, donate_argnums=(1,), out_shardings=out_sh)
    self._score = jax.jit(self._run_scored, donate_argnums=(1,), static_argnames=('top_n',),
                          out_shardings=out_sh and (*out_sh, out_sh[0]))

  def _empty_cache(self):
    return paged.init_kv_cache(self.model_cfg, self.cfg.num_blocks, self.cfg.block_size,
                               self._cache_sharding, self.cfg.kv_cache_dtype)

  def recover_cache(self) -> bool:
    """After a failed step: True if it consumed (donated) or broke the KV cache, which is
    then rebuilt empty, so every cached block's contents are gone."""
    try:
      if not any(x.is_deleted() for x in self.cache):
        jax.block_until_ready(self.cache)   # an async failure surfaces here
        return False
    except Exception:  # pylint: disable=broad-except
      pass
    self.cache = self._empty_cache()
    return True

  def _place(self, params):
    """Parameters on the device(s), and the cache arrays' shardings (None: one device)."""
    if self.plan is None:
      return paged.unstack_layers(jax.device_put(params), self.model_cfg), None
    axes = logical_axes(self.model_cfg)
    check_divisible(self.plan, self.plan.params, abstract_params(self.model_cfg), axes,
                    _FIELD_OF_AXIS)
    axes = quant.logical_axes(params, axes)   # scales split like their weight's outputs
    params = jax.device_put(params, self.plan.tree(self.plan.params, axes))
    return (paged.unstack_layers(params, self.model_cfg),
            tuple(self.plan.sharding(self.plan.params, axes)
                  for axes in paged.kv_cache_axes(self.cfg.kv_cache_dtype)))

  @property
  def _lora_arrays(self):
    return None if self.lora is None else self.lora.arrays

  def _run(self, params, cache, batch, rope, lora=None):
    logits, cache = paged.sampled_logits(params, cache, batch, self.model_cfg,
                                         impl=self.impl, plan=self.plan, rope=rope, lora=lora)
    greedy = jnp.argmax(logits[:, :self.vocab_size], axis=-1).astype(jnp.int32)
    return logits, greedy, cache

  def _run_scored(self, params, cache, batch, rope, targets, lora=None, *, top_n):
    """_run, plus each token row's log p of its target (the next prompt token; -1: none)
    and the top_n, over the real vocabulary: the prompt logprobs. The head runs over
    slices of SCORE_ROWS rows (lax.map), so its logits never take more than
    SCORE_ROWS x vocab floats, however many tokens the step has."""
    cfg, vocab = self.model_cfg, self.vocab_size
    hidden, cache = paged.paged_forward(params, cache, batch, cfg, impl=self.impl,
                                        plan=self.plan, rope=rope, lora=lora)
    logits = model_logits(params, hidden[:, batch.sample_rows], cfg, self.plan)[0]
    greedy = jnp.argmax(logits[:, :vocab], axis=-1).astype(jnp.int32)
    rows = hidden.shape[1]
    size = min(rows, SCORE_ROWS)
    slices = -(-rows // size)
    pad = slices * size - rows
    h = jnp.pad(hidden[0], ((0, pad), (0, 0))).reshape(slices, 1, size, -1)
    t = jnp.pad(targets, (0, pad), constant_values=-1).reshape(slices, size)

    def score(args):
      h, t = args
      logp = jax.nn.log_softmax(model_logits(params, h, cfg, self.plan)[0, :, :vocab], -1)
      target = jnp.take_along_axis(logp, jnp.maximum(t, 0)[:, None], axis=1)[:, 0]
      rank = jnp.sum(logp >= target[:, None], axis=1, dtype=jnp.int32)   # vLLM's (v1)
      return target, rank, (jax.lax.top_k(logp, top_n) if top_n else None)

    target, rank, top = jax.lax.map(score, (h, t))
    flat = lambda x: x.reshape(slices * size, *x.shape[2:])[:rows]  # noqa: E731
    return logits, greedy, cache, (flat(target), flat(rank), top and jax.tree.map(flat, top))

  @property
  def num_compiles(self) -> int:
    return self._step._cache_size() + self._score._cache_size()

  def warmup(self) -> None:
    """Compiles every token bucket's program now (a step of padding only, which writes
    nothing), so no request waits for a compile later."""
    for t in self._tokens:
      batch = _empty_batch(t, seq_bucket(self.cfg, t), self.cfg)
      batch = paged.PagedBatch(**batch)
      *_, self.cache = self._step(self.params, self.cache, batch, self.rope,
                                  self._lora_arrays)

  def execute(self, out) -> jax.Array:
    """float32 logits [sampled rows, vocab] in chunk order (a row per chunk with
    sample=True, and one per draft token after it); the step's K/V written into the
    cache. `out.chunks` items need token_ids, start_position, block_ids, sample and
    spec_token_ids."""
    res = self.step(out)
    return res.logits[:res.num_sampled]

  def step(self, out, targets=None, top_n: int = 0) -> StepResult:
    """`execute`, with the logits left padded and the greedy tokens beside them.

    targets: per chunk, None or the token ids its rows should score (one per token of
    the chunk; -1: none), giving StepResult.scores with top_n alternatives per row.
    Scored steps are their own programs, compiled on first use (not by warmup)."""
    chunks = list(out.chunks)
    if not chunks:
      empty = jnp.zeros((0, self.model_cfg.vocab_size), jnp.float32)
      return StepResult(empty, jnp.zeros((0,), jnp.int32), 0)
    batch, num_sampled = self.build_batch(chunks)
    if targets is None or all(t is None for t in targets):
      logits, greedy, self.cache = self._step(self.params, self.cache, batch, self.rope,
                                              self._lora_arrays)
      return StepResult(logits, greedy, num_sampled)
    rows = np.full(batch.tokens.shape, -1, np.int32)
    row = 0
    for c, t in zip(chunks, targets):
      if t is not None:
        rows[row:row + len(c.token_ids)] = t
      row += len(c.token_ids)
    logits, greedy, self.cache, scores = self._score(self.params, self.cache, batch,
                                                     self.rope, rows, self._lora_arrays,
                                                     top_n=top_n)
    return StepResult(logits, greedy, num_sampled, scores)

  def build_batch(self, chunks) -> tuple[paged.PagedBatch, int]:
    """The padded host-side batch (numpy arrays) for `chunks`, and how many of them are
    sampled."""
    cfg = self.cfg
    num_tokens = sum(len(c.token_ids) for c in chunks)
    self._check_sizes(len(chunks), num_tokens)
    t = _bucket(num_tokens, self._tokens)
    a = _empty_batch(t, seq_bucket(cfg, t), cfg)
    row, sampled = 0, 0
    for i, c in enumerate(chunks):
      n, start = len(c.token_ids), c.start_position
      table = self._check_chunk(i, c)
      pos = np.arange(start, start + n)
      a['tokens'][row:row + n] = c.token_ids
      a['positions'][row:row + n] = pos
      a['slots'][row:row + n] = table[pos // cfg.block_size] * cfg.block_size + (
          pos % cfg.block_size)
      if 'row_slot' in a:   # the rows of its LoRA adapter (0: the base)
        a['row_slot'][row:row + n] = getattr(c, 'lora_slot', 0)
      a['kv_lens'][i] = start + n
      a['page_indices'][i, :len(table)] = table
      row += n
      a['cu_q_lens'][i + 1:] = row
      if c.sample:
        rows = 1 + len(c.spec_token_ids)
        a['sample_rows'][sampled:sampled + rows] = np.arange(row - rows, row)
        sampled += rows
    a['num_seqs'][0] = len(chunks)
    # numpy leaves: the jitted step moves them to the device in its C++ dispatch; a
    # jnp.asarray each would be a Python dispatch per array, every step.
    return paged.PagedBatch(**a), sampled

  def _check_sizes(self, num_chunks: int, num_tokens: int) -> None:
    cfg = self.cfg
    if num_chunks > cfg.max_num_seqs:
      raise ValueError(f'{num_chunks} chunks in one step exceed runner max_num_seqs='
                       f'{cfg.max_num_seqs}; schedule fewer or raise it.')
    if num_tokens > cfg.max_num_batched_tokens:
      raise ValueError(f'{num_tokens} tokens in one step exceed runner '
                       f'max_num_batched_tokens={cfg.max_num_batched_tokens}.')

  def _check_chunk(self, i: int, c) -> np.ndarray:
    cfg = self.cfg
    table = np.asarray(c.block_ids, np.int64)
    end = c.start_position + len(c.token_ids)
    if not c.token_ids or c.start_position < 0:
      raise ValueError(f'chunk {i}: needs at least one token and start_position >= 0.')
    if end > cfg.max_model_len:
      raise ValueError(f'chunk {i} ends at position {end}, past max_model_len='
                       f'{cfg.max_model_len}.')
    if len(table) * cfg.block_size < end or len(table) > cfg.pages_per_seq:
      raise ValueError(f'chunk {i}: {len(table)} blocks of {cfg.block_size} tokens do not '
                       f'cover its {end} tokens (or exceed max_model_len).')
    if table.size and (table.min() < 0 or table.max() >= cfg.num_blocks):
      raise ValueError(f'chunk {i}: block ids must lie in [0, {cfg.num_blocks}).')
    return table


def _empty_batch(t: int, s: int, cfg: RunnerConfig) -> dict[str, np.ndarray]:
  zeros = lambda *shape: np.zeros(shape, np.int32)
  lora = {'row_slot': zeros(t)} if cfg.max_loras else {}
  return dict(**lora, tokens=zeros(t), positions=zeros(t),
              # Past the end of the cache: the scatter drops padding rows' K/V.
              slots=np.full(t, cfg.num_blocks * cfg.block_size, np.int32),
              kv_lens=zeros(s), page_indices=zeros(s, cfg.pages_per_seq),
              cu_q_lens=zeros(s + 1), num_seqs=zeros(1),
              sample_rows=zeros(sample_bucket(cfg, t)))
