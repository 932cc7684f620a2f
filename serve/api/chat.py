"""/v1/chat/completions: messages under the model's chat template, tool calls read from
the output, and OpenAI's chat shapes, streamed or whole."""

import asyncio

import fastapi

from serve.api.choices import compile_guided, submit_off_loop
from serve.api.lora import adapter_of
from serve.api.prompts import chat_prompt, chat_tools, check_common, request_params
from serve.api.protocol import ChatBody, json_body, validate
from serve.api.responses import (chat_logprobs, chunk_usage, logprob_entries, response_meta, sse,
                                 usage, vllm_prompt_logprobs)
from serve.api.state import Choice, ServerState
from serve.api.streaming import events, respond
from serve.api.tool_parsers import Delta


async def _chat_events(state, reqs, body: ChatBody, want_logprobs: bool):
  meta = response_meta('chat.completion.chunk', state, reqs)
  for r in reqs:   # each choice opens with its role
    first = {'index': r.index, 'delta': {'role': 'assistant', 'content': ''},
             'logprobs': None, 'finish_reason': None}
    yield sse({**meta, 'choices': [first], **chunk_usage(body, r)})

  def choice(r, out):
    entries = logprob_entries(out) if want_logprobs else []
    new = _tool_delta(r, out.new_text)
    if not (new.content or new.tool_calls or entries or r.finish_reason):
      return None
    delta = {'content': new.content} if new.content else {}
    if new.tool_calls:
      delta['tool_calls'] = new.tool_calls
    logprobs = chat_logprobs(state.served.tokenizer, entries) if want_logprobs else None
    return {'index': r.index, 'delta': delta, 'logprobs': logprobs,
            'finish_reason': _chat_finish_reason(r)}

  async for event in events(state, reqs, body, meta, choice, want_logprobs):
    yield event


def _tool_delta(r: Choice, text: str) -> Delta:
  """A chat delta's text as content and tool calls (all content without tools); the
  parser's last word when the request has finished."""
  if r.tool_parser is None:
    return Delta(text)
  new = r.tool_parser.feed(text)
  return new + r.tool_parser.finish() if r.finish_reason is not None else new


def _chat_finish_reason(r: Choice) -> str | None:
  """"tool_calls" for a choice that called tools under "auto" or "required" and ended
  itself (OpenAI's; a named function was asked for, and ends with "stop")."""
  if (r.finish_reason == 'stop' and r.tools is not None and r.tools.ends_with_calls
      and r.tool_parser.calls):
    return 'tool_calls'
  return r.finish_reason


def _chat_message(r: Choice) -> dict:
  if r.tool_parser is None:
    return {'role': 'assistant', 'content': r.text}
  whole = _tool_delta(r, r.text)   # the parser has seen nothing: non-streamed
  return {'role': 'assistant', 'content': whole.content or None,
          **({'tool_calls': [c.openai() for c in r.tool_parser.calls]}
             if r.tool_parser.calls else {})}


def _chat_json(state, reqs, want_logprobs: bool) -> dict:
  choices = [{'index': r.index, 'message': _chat_message(r),
              'finish_reason': _chat_finish_reason(r),
              'logprobs': (chat_logprobs(state.served.tokenizer, r.logprobs)
                           if want_logprobs else None)} for r in reqs]
  return {**response_meta('chat.completion', state, reqs), 'choices': choices, 'usage': usage(reqs),
          **({'prompt_logprobs': vllm_prompt_logprobs(state.served.tokenizer, reqs[0])}
             if reqs[0].vllm_prompt_logprobs else {})}   # vLLM's, at the top level


def _chat_request(state: ServerState, raw: dict):
  """(body, tools, the sampling fields, the prompt's token ids, SamplingParams)."""
  body = validate(ChatBody, raw)
  check_common(state, body)
  tools, fields = chat_tools(state, raw)
  prompt = chat_prompt(state, body, tools)
  return body, tools, fields, prompt, request_params(state, fields, len(prompt), chat=True)


async def chat(state: ServerState, request: fastapi.Request):
  raw = await json_body(request)
  body, tools, fields, prompt, params = await asyncio.to_thread(_chat_request, state, raw)
  await compile_guided(state, fields, params,
                       'tools' if tools is not None and tools.regex else None)
  reqs = await submit_off_loop(state, [prompt], [params], body.n,
                               adapter_of(state, body.model))
  for r in reqs:
    r.vllm_prompt_logprobs = params.prompt_logprobs is not None
    r.tools = tools
    r.tool_parser = tools.parser() if tools else None
  return await respond(state, request, reqs, body, params.logprobs is not None,
                       _chat_events, _chat_json)
