"""/v1/completions: text or token prompts, echo (with the prompt's logprobs), and
OpenAI's completions shapes, streamed or whole."""

import asyncio

import fastapi

from serve.api.choices import compile_guided, submit_off_loop
from serve.api.lora import adapter_of
from serve.api.prompts import check_common, completion_prompts, prompt_only, request_params
from serve.api.protocol import CompletionBody, json_body, validate
from serve.api.responses import (completion_logprobs, logprob_entries, prompt_scores,
                                 response_meta, usage, vllm_prompt_logprobs)
from serve.api.state import Choice, ServerState
from serve.api.streaming import events, respond


def _echo_entries(r: Choice) -> list:
  """The echoed prompt's logprob entries: its first token has none."""
  first = [(r.prompt_ids[0], None, None)]
  return first + [(e.token_id, e.logprob, e.top) for e in prompt_scores(r)[1:]]


def _completion_events(state, reqs, body: CompletionBody, want_logprobs: bool):
  def choice(r, out):
    text, entries = out.new_text, logprob_entries(out) if want_logprobs else []
    if r.echo is not None:   # the prompt goes first, with the first output
      text, r.echo = r.echo + text, None
      entries = (_echo_entries(r) if want_logprobs else []) + entries
    logprobs = None
    if want_logprobs:
      logprobs = completion_logprobs(state.served.tokenizer, entries, r.logprob_offset)
      r.logprob_offset += sum(len(t) for t in logprobs['tokens'])
    if not (text or entries or r.finish_reason):
      return None
    return {'index': r.index, 'text': text, 'logprobs': logprobs,
            'finish_reason': r.finish_reason}

  return events(state, reqs, body, response_meta('text_completion', state, reqs), choice,
                want_logprobs)


def _completion_json(state, reqs, want_logprobs: bool) -> dict:
  tokenizer = state.served.tokenizer

  def logprobs(r):
    echoed = _echo_entries(r) if r.echo is not None else []
    return completion_logprobs(tokenizer, echoed + r.logprobs, 0)

  choices = [{'index': r.index, 'text': (r.echo or '') + r.text,
              'finish_reason': r.finish_reason,
              'logprobs': logprobs(r) if want_logprobs else None,
              **({'prompt_logprobs': vllm_prompt_logprobs(tokenizer, r)}
                 if r.vllm_prompt_logprobs else {})} for r in reqs]
  return {**response_meta('text_completion', state, reqs), 'choices': choices,
          'usage': usage(reqs)}


def _completion_request(state: ServerState, raw: dict):
  """(body, prompts' token ids, echoed texts, SamplingParams per prompt)."""
  body = validate(CompletionBody, raw)
  check_common(state, body)
  prompts, texts = completion_prompts(state, body)
  return body, prompts, texts, [request_params(state, raw, len(p), chat=False)
                                for p in prompts]


async def completions(state: ServerState, request: fastapi.Request):
  raw = await json_body(request)
  body, prompts, texts, params = await asyncio.to_thread(_completion_request, state, raw)
  await compile_guided(state, raw, params[0])
  reqs = await submit_off_loop(state, prompts, params, body.n, adapter_of(state, body.model))
  for r in reqs:
    r.vllm_prompt_logprobs = raw.get('prompt_logprobs') is not None
    if body.echo:
      r.echo = texts[r.index // (body.n or 1)]
      r.prompt_only = prompt_only(raw, chat=False)
  return await respond(state, request, reqs, body, params[0].logprobs is not None,
                       _completion_events, _completion_json)
