"""Batch generation: every prompt of a JSONL file through the engine together.

  python -m serve.generate --checkpoint runs/default --prompts in.jsonl --output out.jsonl

Each input line is a JSON object with one of `prompt` (text, encoded with the tokenizer's
special tokens, a Llama's BOS), `prompt_token_ids` or `messages` (a chat, rendered with
the model's chat template), plus sampling fields by their OpenAI and vLLM names (every
SamplingParams field: max_tokens, temperature, top_p, top_k, min_p, seed, stop,
stop_token_ids, ignore_eos, min_tokens, include_stop_str_in_output, logprobs, the
penalties, logit_bias, allowed_token_ids, bad_words, skip_special_tokens, guided_regex,
guided_grammar, prompt_logprobs, truncate_prompt_tokens; response_format, guided_json,
guided_choice and structured_outputs for structured output; those left out take the
model's generation_config.json defaults), an optional
`id` copied to the output, and an optional `model`: a LoRA adapter's name from
--lora-modules (with --enable-lora, as the server's requests name one) or the base
model's, copied to the output. Output lines come in input order. A bad line stops the run
before any generation, with one line naming the line and the field (exit status 2).
"""

import argparse
import dataclasses
import json
import sys

from rich import progress

from serve import config as config_lib
from serve.api.openai_sampling import from_openai, guided_field, truncate_prompt
from serve.engine.constraints import bad_word_ids
from serve.sampling_params import SamplingParams, SamplingParamsError
from sharding import compile_cache

PROMPT_KEYS = ('prompt', 'prompt_token_ids', 'messages')
OPENAI_EXTRA = ('max_completion_tokens', 'top_logprobs', 'n', 'best_of', 'response_format',
                'guided_json', 'guided_choice', 'guided_whitespace_pattern',
                'structured_outputs', 'truncate_prompt_tokens')
KNOWN = {'id', 'model', *PROMPT_KEYS, *OPENAI_EXTRA,
         *(f.name for f in dataclasses.fields(SamplingParams))}
# Chat fields only the HTTP server takes (tool calling, template variables).
SERVER_ONLY = ('tools', 'tool_choice', 'parallel_tool_calls', 'functions', 'function_call',
               'chat_template_kwargs')


class BadLine(ValueError):
  """An input line the run cannot use; the message names the line and the field."""


@dataclasses.dataclass
class Job:
  line: int
  body: dict
  prompt_ids: list[int] = dataclasses.field(default_factory=list)
  params: SamplingParams | None = None
  lora: str | None = None   # the LoRA adapter its `model` names (None: the base)


def read_jobs(path: str) -> list[Job]:
  """Parses the JSONL file (blank lines skipped); BadLine on the first bad line."""
  jobs = []
  with open(path, encoding='utf-8') as f:
    for number, text in enumerate(f, 1):
      if text.strip():
        jobs.append(Job(number, _parse_line(path, number, text)))
  if not jobs:
    raise BadLine(f'{path}: no prompts (one JSON object per line).')
  return jobs


def _parse_line(path: str, number: int, text: str) -> dict:
  where = f'{path} line {number}'
  try:
    body = json.loads(text)
  except json.JSONDecodeError as e:
    raise BadLine(f'{where}: not valid JSON ({e.msg} at column {e.colno}).') from None
  if not isinstance(body, dict):
    raise BadLine(f'{where}: must be a JSON object, got {type(body).__name__}.')
  given = [k for k in PROMPT_KEYS if k in body]
  if len(given) != 1:
    raise BadLine(f'{where}: give exactly one of {", ".join(PROMPT_KEYS)} '
                  f'(found {given or "none"}).')
  server_only = [k for k in SERVER_ONLY if k in body]
  if server_only:
    raise BadLine(f'{where}: field {server_only[0]!r}: tool calling and template variables '
                  'are served by the HTTP server (python -m serve), not the batch CLI.')
  unknown = sorted(set(body) - KNOWN)
  if unknown:
    raise BadLine(f'{where}: unknown field {unknown[0]!r}; known fields: '
                  f'{", ".join(sorted(KNOWN))}.')
  return body


def prepare(job: Job, served, engine, path: str) -> None:
  """Tokenizes the prompt and builds the SamplingParams; BadLine names the field."""
  body, where = job.body, f'{path} line {job.line}'
  job.lora = _adapter(body.get('model'), served, engine, where)
  try:
    text = body['prompt'] if isinstance(body.get('prompt'), str) else None   # with specials
    job.prompt_ids = truncate_prompt(_prompt_ids(body, served), body, engine.max_model_len,
                                     served.tokenizer, text)
    sampling = {k: v for k, v in body.items()
                if k not in (*PROMPT_KEYS, 'id', 'model', 'truncate_prompt_tokens')}
    job.params = from_openai(sampling, engine.vocab_size, chat='messages' in body,
                             defaults=served.sampling_defaults)
    bad_word_ids(served.tokenizer, job.params.bad_words)   # each spells some token
    engine.check_prompt(job.prompt_ids, job.params)
    if job.params.guided:
      try:
        engine.compile_guided(job.params)
      except ValueError as e:
        raise SamplingParamsError(guided_field(body), str(e)) from None
  except SamplingParamsError as e:
    why = str(e).removeprefix(f'{e.param}: ')
    raise BadLine(f'{where}: field {e.param!r}: {why}') from None
  except (ValueError, TypeError) as e:
    field = next(k for k in PROMPT_KEYS if k in body)
    raise BadLine(f'{where}: field {field!r}: {e}') from None


def _adapter(model, served, engine, where: str) -> str | None:
  """The LoRA adapter a line's `model` names (None: the base, by its name or none)."""
  if model is None or model == served.name:
    return None
  registry = getattr(engine, 'lora', None)
  names = [] if registry is None else [a['name'] for a in registry.names()]
  if model not in names:
    served_names = f'the LoRA adapters {names}' if names else (
        'no LoRA adapters (--enable-lora --lora-modules NAME=DIR)')
    raise BadLine(f'{where}: field \'model\': {model!r} is not served: the base is '
                  f'{served.name!r}, with {served_names}.')
  return model


def _prompt_ids(body: dict, served) -> list[int]:
  if 'prompt_token_ids' in body:
    ids = body['prompt_token_ids']
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):  # noqa: E721
      raise ValueError('must be a list of integer token ids.')
    return ids
  if 'messages' in body:
    # pylint: disable=import-outside-toplevel
    from serve.api.chat_template import render_chat
    from serve.api.tools import template_messages
    if not isinstance(body['messages'], list):
      raise ValueError('must be a list of {"role": ..., "content": ...} objects.')
    # Past tool calls' arguments as objects, as the server gives them to the template.
    messages = template_messages(body['messages'])
    # No special tokens added: the chat template writes them (vLLM's chat default).
    return served.tokenizer.encode(render_chat(served, messages)).tolist()
  if not isinstance(body['prompt'], str):
    raise ValueError('must be a string (use prompt_token_ids for token ids).')
  # A text prompt gets the tokenizer's special tokens (a Llama's BOS), as vLLM adds them.
  return served.tokenizer.encode(body['prompt'], add_special_tokens=True).tolist()


def _entry(lp) -> dict:
  """A TokenLogprob as JSON: token_id, logprob, top [[id, logprob], ...], and rank (the
  tokens at least as likely, it included) where known."""
  out = dataclasses.asdict(lp)
  if out['rank'] is None:
    del out['rank']
  return out


def result_line(job: Job, result) -> dict:
  out = {k: job.body[k] for k in ('id', 'model') if k in job.body}
  out.update(index=job.line, text=result.text, token_ids=result.token_ids,
             finish_reason=result.finish_reason, num_prompt_tokens=len(job.prompt_ids),
             num_output_tokens=len(result.token_ids))
  if result.logprobs is not None:
    out['logprobs'] = [_entry(lp) for lp in result.logprobs]
  if result.prompt_logprobs is not None:   # [None, then one per prompt token after the first]
    out['prompt_logprobs'] = [lp and _entry(lp) for lp in result.prompt_logprobs]
  if result.error:
    out['error'] = result.error
  return out


def run(engine, jobs: list[Job]) -> list:
  """All jobs through the engine together, with a progress bar."""
  columns = (progress.TextColumn('generating'), progress.BarColumn(),
             progress.MofNCompleteColumn(), progress.TimeElapsedColumn())
  with progress.Progress(*columns, transient=False) as bar:
    task = bar.add_task('generate', total=len(jobs))
    engine.add_observer(lambda _metrics: bar.advance(task))
    return engine.generate([j.prompt_ids for j in jobs], [j.params for j in jobs],
                           loras=[j.lora for j in jobs])


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog='python -m serve.generate', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--prompts', required=True, metavar='IN.jsonl')
  parser.add_argument('--output', required=True, metavar='OUT.jsonl')
  config_lib.add_engine_args(parser)
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  from serve.engine.core import Engine  # pylint: disable=import-outside-toplevel
  try:
    compile_cache.enable(args.compilation_cache_dir)   # before the engine compiles
    cfg = config_lib.config_from_args(args)
    jobs = read_jobs(args.prompts)
    served = config_lib.load_served_model(args)
    engine = Engine(served, cfg)
    served = engine.served   # without the loaded weights: the engine's copy is the one kept
  except (BadLine, ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  try:
    for job in jobs:
      prepare(job, served, engine, args.prompts)
    results = run(engine, jobs)
  except BadLine as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  finally:
    engine.shutdown()
  with open(args.output, 'w', encoding='utf-8') as f:
    for job, result in zip(jobs, results):
      f.write(json.dumps(result_line(job, result), ensure_ascii=False) + '\n')
  print(f'{len(results)} completions written to {args.output}', file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
