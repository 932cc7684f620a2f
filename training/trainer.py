"""The train loop: set up mesh, state, data and checkpoints; step; log; save; sample."""

import dataclasses
import json
import os
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from rich.console import Console

from model import moe
from sharding import compile_cache
from sharding.mesh import make_mesh
from sharding.rules import ShardingPlan, check_divisible, make_plan
from training import (checkpoint, config as config_lib, data, family, lora_run, metrics,
                      optimizer, pretrained, processes, resilience, sample, source_data, state)

console = Console(stderr=True)

# Which config field sets each logical axis's size (for divisibility errors).
_FIELD_OF_AXIS = {
    'vocab': 'model.vocab_size', 'embed': 'model.embed_dim', 'heads': 'model.num_heads',
    'kv_heads': 'model.num_kv_heads', 'mlp': 'model.mlp_dim', 'layers': 'model.num_layers',
    'experts': 'model.num_experts',
}


class ConfigError(ValueError):
  """A config that cannot run; the message names the field and the fix."""


@dataclasses.dataclass
class Trainer:
  cfg: config_lib.Config
  plan: ShardingPlan
  tx: object
  schedule: object
  ckpt: checkpoint.Checkpointer
  data_iter: object
  tokenizer: object
  is_main: bool
  events: resilience.Events
  eval_batches: list | None = None   # this process's held-out batches, with eval on
  step: int | None = None           # the last dispatched step (metrics maybe still on device)
  pending_save: int | None = None   # a save started but not yet known to be committed
  eval_fn: object = None            # the compiled eval step, once evaluated
  lora_base: dict | None = None     # a LoRA run's base identity (lora_run.load_base)


def setup(cfg: config_lib.Config) -> Trainer:
  """Everything a run needs, each config problem reported before any device work."""
  from_hf = []
  try:
    config_lib.validate_lora_base(cfg)
    cfg, from_hf = pretrained.with_pretrained(cfg)
    processes.check_agree(cfg)
    config_lib.validate(cfg, jax.device_count(), jax.default_backend())
    info = _data_info(cfg)
    if not family.is_user(cfg) and info.vocab_size > cfg.model.vocab_size:
      raise ValueError(f'model.vocab_size={cfg.model.vocab_size} is smaller than the '
                       f'tokenizer vocabulary ({info.vocab_size}): raise it.')
    plan = build_plan(cfg)
    fam = family.of(cfg)
    shapes, axes = fam.abstract_params(), fam.logical_axes()
    for rules in (plan.params, plan.grads, plan.opt_state):
      check_divisible(plan, rules, shapes, axes,
                      None if family.is_user(cfg) else _FIELD_OF_AXIS)
    # the rows this process's devices hold: all of them when a model axis spans processes
    rows = plan.process_rows(cfg.data.batch_size, cfg.data.seq_len)[jax.process_index()]
    eval_batches = data.make_eval_batches(cfg, rows=rows) if cfg.eval.every_steps else None
    data_iter = _train_iterator(cfg, rows)
  except (ValueError, FileNotFoundError) as e:
    hint = (f' (the model\'s shape comes from init_from_hf={cfg.init_from_hf!r}: change '
            'the mesh or the data, not model.*)' if from_hf and 'model.' in str(e) else '')
    raise ConfigError(f'{e}{hint}') from e
  is_main = jax.process_index() == 0
  if is_main and fam.unannotated_notice():
    console.print(fam.unannotated_notice(), markup=False, highlight=False, soft_wrap=True)
  if from_hf and is_main:
    console.print(f'init_from_hf sets {", ".join(from_hf)}', highlight=False)
    if cfg.model.num_experts and cfg.model.moe_dispatch == 'capacity':
      console.print('init_from_hf: the released mixture of experts sends every token to its '
                    'experts; this run\'s model.moe_dispatch=capacity drops those over '
                    f'model.capacity_factor={cfg.model.capacity_factor} (set '
                    'model.moe_dispatch=dropless to train what it computes)', highlight=False)
  if is_main:
    try:
      os.makedirs(cfg.workdir, exist_ok=True)
      with open(os.path.join(cfg.workdir, 'config.json'), 'w') as f:
        f.write(config_lib.to_json(cfg))
    except OSError as e:
      raise ConfigError(f'workdir={cfg.workdir!r} cannot be written ({e.strerror}): choose '
                        'another --config.workdir.') from e
  tx = optimizer.make_optimizer(cfg.optim, cfg.steps)
  ckpt = checkpoint.Checkpointer(os.path.join(cfg.workdir, 'checkpoints'), cfg.checkpoint)
  return Trainer(cfg, plan, tx, optimizer.lr_schedule(cfg.optim, cfg.steps), ckpt,
                 data_iter, info.tokenizer, is_main, resilience.Events(cfg.workdir, is_main),
                 eval_batches=eval_batches)


def _data_info(cfg: config_lib.Config) -> data.DataInfo:
  """data.source has no tokenizer (nor token files to read one from)."""
  if cfg.data.source:
    return data.DataInfo(tokenizer=None, vocab_size=0, eos_id=-1)
  return data.data_info(cfg.data)


def _train_iterator(cfg: config_lib.Config, rows: tuple[int, int]):
  if cfg.data.source:
    return source_data.SourceIterator(cfg.data.source, seed=cfg.seed,
                                      batch_size=cfg.data.batch_size, rows=rows)
  return data.make_train_iterator(cfg.data, seed=cfg.seed, rows=rows,
                                  held_out=config_lib.held_out_windows(cfg))


def build_plan(cfg: config_lib.Config, devices=None) -> ShardingPlan:
  """The mesh over `devices` (default: all) and the config's sharding plan on it."""
  mesh = make_mesh(cfg.mesh, devices)
  return family.with_user_rules(_make_plan(cfg, mesh), cfg)


def _make_plan(cfg: config_lib.Config, mesh) -> ShardingPlan:
  return make_plan(mesh, cfg.parallel.zero_stage, cfg.parallel.sequence_parallel,
                   cfg.parallel.context_strategy, cfg.parallel.context_load_balance,
                   config_lib.pipeline_microbatches(cfg, mesh.shape['stage']),
                   cfg.parallel.pipeline_repeats)


def restore_or_init(t: Trainer):
  """(state, step): the newest intact checkpoint, data position included, or a fresh start."""
  target, base = state.abstract_state(t.cfg, t.plan, t.tx), None
  newest = t.ckpt.latest_meta()
  if t.cfg.lora.rank:
    base = _lora_base(t, newest)
    target = target.replace(frozen=None)   # checkpoints hold the adapters only
  _check_workdir(t, newest)
  restored = t.ckpt.restore_latest(target)
  if restored is not None and restored[1] != newest:   # the newest did not read
    if base is not None:   # the base at the step the restored adapters recorded
      base = _lora_base(t, restored[1])
    _check_workdir(t, restored[1])
  if restored is None and base is not None:
    adapter = None
    if t.cfg.lora.init_from_peft:
      try:
        adapter = lora_run.peft_adapter(t.cfg)
      except ValueError as e:
        raise ConfigError(str(e)) from e
    return state.init_state(t.cfg, t.plan, t.tx, base=base, adapter=adapter), 0
  if restored is None:
    start, released = time.perf_counter(), None
    if t.cfg.init_from_hf:
      try:
        released = pretrained.load_params(t.cfg)
      except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f'init_from_hf={t.cfg.init_from_hf!r}: {e}') from e
    train_state = state.init_state(t.cfg, t.plan, t.tx, released)
    if released is not None:
      console.print(f'initialized from the Hugging Face model in {t.cfg.init_from_hf} '
                    f'({time.perf_counter() - start:.1f}s)', highlight=False)
      t.events('initialized_from_hf', directory=t.cfg.init_from_hf)
    return train_state, 0
  train_state, meta = restored
  train_state = train_state.replace(frozen=base)
  saved = meta.get('data_setup') or {}
  if saved.get('held_out', 0) < config_lib.held_out_windows(t.cfg):
    console.print(f'[yellow]warning: evaluation now holds out the last '
                  f'{config_lib.held_out_windows(t.cfg)} windows of the training data, but '
                  f'this checkpoint was trained holding out {saved.get("held_out", 0)}: '
                  'the windows it read are in the held-out set, so its eval loss is not '
                  'on unseen data. Give eval.files to evaluate on data never trained on.[/]')
  if not _same_data_setup(meta.get('data_setup'), data_setup(t)):
    console.print('[yellow]warning: data files, data config or seed changed '
                  'since this checkpoint; the data iterator restarts from its saved index '
                  'on the new data.[/]')
  t.data_iter.set_state(meta['data'])
  console.print(f'resumed from step {meta["step"]} in {t.ckpt.directory}')
  t.events('resumed', step=int(meta['step']),
           rejected=[{k: r[k] for k in ('step', 'reason')} for r in t.ckpt.rejected])
  return train_state, int(meta['step'])


def _check_workdir(t: Trainer, meta: dict | None) -> None:
  try:
    lora_run.check_workdir(meta, t.lora_base, t.ckpt.directory)
  except ValueError as e:
    raise ConfigError(str(e)) from e


def _lora_base(t: Trainer, newest: dict | None):
  """The frozen base (lora.base_checkpoint's, at the step the workdir's newest checkpoint
  recorded on a resume; init_from_hf's or the seed's weights), its identity in t.lora_base."""
  start = time.perf_counter()
  try:
    base, t.lora_base = lora_run.load_base(lora_run.resumed_base(t.cfg, newest), t.plan)
  except (ValueError, FileNotFoundError, checkpoint.CheckpointError) as e:
    where = '' if t.cfg.lora.base_checkpoint else f'init_from_hf={t.cfg.init_from_hf!r}: '
    raise ConfigError(f'{where}{e}') from e
  if t.is_main:
    console.print(f'LoRA base: {t.lora_base["source"]} (checksum {t.lora_base["checksum"]}, '
                  f'{time.perf_counter() - start:.1f}s), frozen in {t.cfg.model.dtype}',
                  highlight=False)
  return base


def data_setup(t: Trainer) -> dict:
  """What the saved data position depends on. Not the process layout: each element of a
  process's iterator is one global step whatever rows it reads, so the position resumes
  exactly onto any number of processes and any mesh."""
  cfg = t.cfg
  held_out = config_lib.held_out_windows(cfg)   # named only when some (older runs: none)
  return {'data': dataclasses.asdict(cfg.data), 'seed': cfg.seed,
          **({'held_out': held_out} if held_out else {})}


def _same_data_setup(saved: dict | None, now: dict) -> bool:
  """Older checkpoints also named the process count and this process's rows."""
  return {k: v for k, v in (saved or {}).items() if k not in ('processes', 'rows')} == now


def global_batch(t: Trainer, local: dict) -> dict:
  return assemble_batch(t.plan, t.cfg.data, local)


def assemble_batch(plan: ShardingPlan, data_cfg: config_lib.DataConfig, local: dict) -> dict:
  """The global batch from this process's rows (ShardingPlan.process_rows). The global
  shape is given: guessed from the local rows, it is wrong whenever a model axis spans
  processes (PITFALLS.md). Token batches are [batch_size, seq_len]; a data.source's
  arrays keep their own trailing shapes, split on the batch axis only."""
  if data_cfg.source:
    return {k: jax.make_array_from_process_local_data(
        source_batch_sharding(plan, np.ndim(v)), np.asarray(v),
        (data_cfg.batch_size, *np.shape(v)[1:])) for k, v in local.items()}
  sharding, shape = plan.batch_sharding(), (data_cfg.batch_size, data_cfg.seq_len)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), shape)
          for k, v in local.items()}


def source_batch_sharding(plan: ShardingPlan, ndim: int):
  """A data.source array's layout: rows over the batch axes, the rest whole."""
  return NamedSharding(plan.mesh, PartitionSpec(plan.activations.table['batch'],
                                                *(None,) * (ndim - 1)))


def compile_step(t: Trainer, train_state, batch):
  start, hits, programs = time.perf_counter(), compile_cache.hits(), compile_cache.programs()
  step_fn = state.make_train_step(t.cfg, t.plan, t.tx, t.schedule)
  compiled = step_fn.lower(train_state, batch).compile()
  mem = compiled.memory_analysis()
  if t.is_main and mem is not None:
    read = compile_cache.hits() - hits
    what = ('train step read from the compilation cache'
            if read and read == compile_cache.programs() - programs else 'compiled train step')
    console.print(f'{what} in {time.perf_counter() - start:.1f}s; per device: '
                  f'arguments {mem.argument_size_in_bytes / 2**20:.1f} MiB, temporaries '
                  f'{mem.temp_size_in_bytes / 2**20:.1f} MiB')
  return compiled


class _Records:
  """Each step's metrics record: fetched from the device one step late, while the next
  step runs, so the host's next batch and dispatch overlap the device's work; at once
  where the loop needs them (eval, checkpoint, stop, the last step)."""

  def __init__(self, t: Trainer, logger: metrics.MetricsLogger):
    cfg = t.cfg
    self._t, self._logger, self.history, self._skips, self._last_done = t, logger, [], 0, 0.0
    self._tokens = cfg.data.batch_size * cfg.data.seq_len
    self._flops = family.of(cfg).flops_per_token(cfg.data.seq_len) * self._tokens
    self._peak = metrics.peak_flops_per_device(cfg.metrics)
    self._pending = []   # (step, metrics on the device, when its batch was taken)

  def dispatched(self, step: int, out: dict, started: float) -> None:
    self._pending.append((step, out, started))

  def fetch(self, keep: int = 0, more=None) -> None:
    """Records all dispatched steps but the last `keep`; `more()` adds fields to the
    last one recorded. A step stays pending until its metrics are on the host, so an
    interrupted fetch loses nothing (flush_after_error)."""
    while len(self._pending) > keep:
      step, out, started = self._pending[0]
      out = {k: float(v) for k, v in jax.device_get(out).items()}
      self._pending.pop(0)
      self._add(step, out, started, more if len(self._pending) == keep else None)

  def flush_after_error(self) -> None:
    """On the way out by an exception: the records of steps that ran, where they can
    still be read (a failed step's cannot; the original error is what is raised)."""
    try:
      self.fetch()
    except Exception:  # pylint: disable=broad-except
      pass

  def _add(self, step: int, out: dict, started: float, more) -> None:
    """`started`: when the step's batch was taken (its time runs from then or from the
    previous step's end, whichever is later)."""
    done = time.perf_counter()
    record = _record(step, out, done - max(started, self._last_done), self._tokens,
                     self._flops, self._peak)
    self._last_done = done
    if more is not None:
      record.update(more())
    self.history.append(record)
    cfg = self._t.cfg
    if (step % cfg.metrics.log_every == 0 or step == cfg.steps or record['skipped']
        or more is not None):
      self._logger.log(record)
    self._skips = _count_skips(self._t, record, self._skips)


def run_loop(t: Trainer, train_state, start: int,
             stop: resilience.StopSignal) -> tuple[object, list[dict]]:
  cfg = t.cfg
  logger = metrics.MetricsLogger(cfg.workdir, cfg.metrics, start_step=start,
                                 total_steps=cfg.steps, enabled=t.is_main)
  records, step_fn, t.step = _Records(t, logger), None, start
  data_state = t.data_iter.get_state()   # the data position matching `train_state`
  try:
    while t.step < cfg.steps:
      tic = time.perf_counter()
      batch = global_batch(t, next(t.data_iter))
      if step_fn is None:
        step_fn = compile_step(t, train_state, batch)
        tic = time.perf_counter()   # compile time stays out of step_time_s
      train_state, out = step_fn(train_state, batch)
      t.step, data_state = t.step + 1, t.data_iter.get_state()
      records.dispatched(t.step, out, tic)
      evaluated = cfg.eval.every_steps and (t.step % cfg.eval.every_steps == 0
                                            or t.step == cfg.steps)
      saving = t.step % cfg.checkpoint.every_steps == 0 or t.step == cfg.steps
      stopping = stop.should_stop(t.step) and t.step < cfg.steps
      if not (evaluated or saving or stopping):
        records.fetch(keep=1)   # the previous step's: the device runs this one meanwhile
        continue
      params, frozen = train_state.params, train_state.frozen
      records.fetch(more=(lambda: evaluate(t, params, frozen)) if evaluated else None)
      if saving:
        save(t, t.step, train_state, data_state)
      if stopping:
        _save_and_stop(t, train_state, data_state)
  except KeyboardInterrupt:
    records.flush_after_error()
    _save_on_interrupt(t, t.step, start, train_state, data_state)
    raise
  except resilience.RunStopped:
    raise   # too many skipped steps: the run stops at the step that said so
  except Exception:
    records.flush_after_error()
    raise
  finally:
    logger.close()
    commit_pending(t)
  return train_state, records.history


def evaluate(t: Trainer, params, frozen=None) -> dict:
  """{eval_loss, eval_perplexity, eval_tokens} over the held-out batches: the weighted
  mean token loss, as training's (the eval step compiled on first use); frozen: a LoRA
  run's base, `params` its adapters."""
  start = time.perf_counter()
  totals = []
  for local in t.eval_batches:
    batch = global_batch(t, local)
    if t.eval_fn is None:
      t.eval_fn = state.make_eval_step(t.cfg, t.plan).lower(params, batch, frozen).compile()
      if t.is_main:
        console.print(f'compiled eval step in {time.perf_counter() - start:.1f}s')
    totals.append(t.eval_fn(params, batch, frozen))
  nll, weight = np.sum(np.asarray(jax.device_get(totals), np.float64), axis=0)
  loss = float(nll / max(weight, 1.0))
  result = {'eval_loss': loss, 'eval_perplexity': float(np.exp(min(loss, 80.0))),
            'eval_tokens': int(weight)}
  if t.is_main:
    console.print(f'eval at step {t.step}: loss {loss:.4f}, perplexity '
                  f'{result["eval_perplexity"]:.2f} ({result["eval_tokens"]} tokens, '
                  f'{time.perf_counter() - start:.1f}s)', highlight=False)
  return result


def _count_skips(t: Trainer, record: dict, skips: int) -> int:
  """Consecutive skipped steps so far; too many stop the run."""
  if not record['skipped']:
    return 0
  t.events('skipped', step=record['step'], reason=record['skipped'])
  console.print(f'[yellow]step {record["step"]} skipped: {record["skipped"]}[/]')
  skips += 1
  if skips >= t.cfg.optim.max_skipped_steps:
    latest = max(t.ckpt.steps(), default=None)
    raise resilience.TooManySkippedSteps(
        f'{skips} steps in a row (to step {record["step"]}) had a {record["skipped"]} and were '
        f'skipped (optim.max_skipped_steps={t.cfg.optim.max_skipped_steps}); stopped. '
        f'Newest checkpoint: {latest} in {t.ckpt.directory}. Lower optim.learning_rate or '
        'check the data, then run again to resume.', step=record['step'])
  return skips


def _save_and_stop(t: Trainer, train_state, data_state) -> None:
  """SIGTERM: the finished step is saved and committed, then the run stops."""
  if t.step not in t.ckpt.steps():
    save(t, t.step, train_state, data_state)
  commit_pending(t)
  latest = max(t.ckpt.steps(), default=None)
  raise resilience.Preempted(
      f'preempted (SIGTERM) after step {t.step}; newest checkpoint: step {latest} in '
      f'{t.ckpt.directory}. Run the same command again to resume.')


def _save_on_interrupt(t: Trainer, step: int, start: int, train_state, data_state) -> None:
  """Keeps what was trained; a state donated to an interrupted step is gone, though."""
  if step == start or step in t.ckpt.steps():
    return
  if any(x.is_deleted() for x in jax.tree.leaves(train_state)):
    console.print(f'[yellow]interrupted inside step {step + 1}: its input state was '
                  'donated, nothing more to save[/]')
    return
  save(t, step, train_state, data_state)
  console.print(f'saved step {step} before stopping')


def save(t: Trainer, step: int, train_state, data_state: dict) -> None:
  """Starts a save (in the background with checkpoint.async_save). A failed save, this
  one's start or the previous one's commit, goes to `_save_failed`."""
  commit_pending(t)
  try:
    extra = {'lora_base': t.lora_base} if t.lora_base else {}
    t.ckpt.save(step, train_state.replace(frozen=None),
                {'data': data_state, 'data_setup': data_setup(t), **extra})
  except Exception as e:  # pylint: disable=broad-except
    _save_failed(t, step, e)
    return
  t.pending_save = step
  if not t.cfg.checkpoint.async_save:
    commit_pending(t)


def commit_pending(t: Trainer) -> None:
  """Waits for the save in flight; 'saved' goes to events.jsonl once it is committed."""
  step, t.pending_save = t.pending_save, None
  try:
    t.ckpt.wait()
  except Exception as e:  # pylint: disable=broad-except
    _save_failed(t, step, e)
    return
  if step is not None:
    t.events('saved', step=step)


def _save_failed(t: Trainer, step: int | None, error: Exception) -> None:
  """One line on the console and in events.jsonl; stops the run if configured to."""
  reason = ' '.join(f'{type(error).__name__}: {error}'.split())
  if len(reason) > 800:   # the cause is at the end of orbax's and tensorstore's messages
    reason = f'{reason[:300]} ... {reason[-500:]}'
  message = f'checkpoint {step} could not be saved in {t.ckpt.directory} ({reason})'
  t.events('save_failed', step=step, error=reason)
  if t.cfg.checkpoint.on_save_error == 'stop':
    raise resilience.SaveFailed(
        f'{message}; stopped (checkpoint.on_save_error=stop). Older checkpoints are '
        'intact: free space or fix the directory, then run the same command to resume.')
  console.print(f'[yellow]warning: {message}; training goes on, the next save tries '
                'again.[/]', highlight=False, soft_wrap=True)


def _record(step, out, elapsed, tokens_per_step, flops_per_step, peak) -> dict:
  mfu = None
  if peak and flops_per_step:
    mfu = flops_per_step / elapsed / (peak * jax.device_count())
  skipped = None
  if out['skipped']:
    skipped = 'non-finite loss' if not np.isfinite(out['loss']) else 'non-finite gradients'
  moe_aux = {k: out[k] for k in moe.AUX_KEYS if k in out}   # MoE models only
  return {'step': step, 'loss': out['loss'], 'grad_norm': out['grad_norm'], 'lr': out['lr'],
          'tokens_per_sec': tokens_per_step / elapsed, 'step_time_s': elapsed, 'mfu': mfu,
          'skipped': skipped, **moe_aux}


def startup_line(t: Trainer, start: int) -> str:
  cfg, shape = t.cfg, dict(t.plan.mesh.shape)
  zero = f'ZeRO-{cfg.parallel.zero_stage}'
  if cfg.parallel.zero_stage and shape['fsdp'] == 1:
    zero += ' (fsdp=1: nothing to shard, so data parallel)'
  if cfg.parallel.offload_optimizer:
    zero += ', optimizer state in host memory'
  notes = [f'{family.of(cfg).count_params() / 1e6:.2f}M parameters on mesh {shape}, {zero}',
           _lora_note(cfg),
           f'steps {start} -> {cfg.steps}', f'workdir {os.path.abspath(cfg.workdir)}',
           metrics.mfu_note(cfg.metrics)]
  return '; '.join(filter(None, notes))


def _lora_note(cfg: config_lib.Config) -> str:
  if not cfg.lora.rank:
    return ''
  trained = sum(x.size for x in jax.tree.leaves(state.trainable_abstract(cfg)))
  return (f'LoRA rank {cfg.lora.rank} on {",".join(cfg.lora.targets)}: '
          f'{trained / 1e6:.3f}M trained, the base frozen')


def print_sample(t: Trainer, params) -> str:
  cfg = t.cfg.sample
  prompt = t.tokenizer.encode(cfg.prompt)
  ids = sample.generate(params, t.cfg.model, prompt, cfg.num_tokens, cfg.temperature,
                        seed=t.cfg.seed)
  text = t.tokenizer.decode(ids)
  if t.is_main:
    console.rule('sample')
    console.print(cfg.prompt + text, markup=False, highlight=False)
    console.rule()
  return text


def train(cfg: config_lib.Config) -> list[dict]:
  """Trains cfg.steps steps (resuming from cfg.workdir) and returns the per-step records.

  Every way this ends leaves a line in workdir/events.jsonl; SIGTERM saves the last
  finished step and raises resilience.Preempted.
  """
  t = setup(cfg)
  t.events('started', steps=cfg.steps, processes=jax.process_count(),
           devices=jax.device_count())
  try:
    with resilience.StopSignal() as stop:
      train_state, start = restore_or_init(t)
      if t.is_main:
        console.print(startup_line(t, start), markup=False, highlight=False)
      train_state, history = run_loop(t, train_state, start, stop)
  except BaseException as e:
    t.events.stopped(e, t.step)
    raise
  if history and t.is_main:
    console.print(json.dumps({k: history[-1][k] for k in ('step', 'loss')}))
  if cfg.sample.num_tokens > 0 and family.is_user(cfg):
    console.print(f'no sample (sample.num_tokens={cfg.sample.num_tokens}): the sampler runs '
                  'the built-in model, not a model.module', highlight=False)
  elif cfg.sample.num_tokens > 0:
    print_sample(t, state.model_params(cfg, train_state))
  t.events('finished', step=t.step, newest_checkpoint=max(t.ckpt.steps(), default=None))
  t.ckpt.close()
  t.data_iter.close()
  return history
