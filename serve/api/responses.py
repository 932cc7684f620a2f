"""Responses in OpenAI's shapes: server-sent events, usage, logprobs of completions and of
chat, and vLLM's prompt_logprobs."""

import functools
import json
import time
import uuid

from serve.api.protocol import ApiError, Body
from serve.api.state import Choice, ServerState


def sse(payload) -> str:
  return f'data: {json.dumps(payload, ensure_ascii=False)}\n\n'


def usage(reqs: list[Choice]) -> dict:
  prompt = sum(len(r.prompt_ids) for r in reqs if r.counts_prompt)
  completion = sum(len(r.token_ids) for r in reqs)
  return {'prompt_tokens': prompt, 'completion_tokens': completion,
          'total_tokens': prompt + completion}


def token_text(tokenizer, token_id: int) -> str:
  return tokenizer.decode([token_id])


def _token_bytes(tokenizer, token_id: int) -> list[int]:
  if getattr(tokenizer, 'name', '') == 'byte':
    return [token_id] if token_id < 256 else []
  return list(token_text(tokenizer, token_id).encode('utf-8'))


def completion_logprobs(tokenizer, entries, offset: int) -> dict:
  """OpenAI's completions shape; offset: the text length before the first entry."""
  out = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}
  for token_id, logprob, top in entries:   # logprob None: an echoed prompt's first token
    text = token_text(tokenizer, token_id)
    out['tokens'].append(text)
    out['token_logprobs'].append(logprob)
    out['top_logprobs'].append(
        {token_text(tokenizer, t): lp for t, lp in top} if top else None)
    out['text_offset'].append(offset)
    offset += len(text)
  return out


def chat_logprobs(tokenizer, entries) -> dict:
  def item(token_id, logprob):
    return {'token': token_text(tokenizer, token_id), 'logprob': logprob,
            'bytes': _token_bytes(tokenizer, token_id)}
  return {'content': [{**item(t, lp), 'top_logprobs': [item(i, l) for i, l in top or ()]}
                      for t, lp, top in entries]}


def logprob_entries(out) -> list:
  """(token_id, logprob, [(id, logprob)] | None) for each new token of a delta."""
  return [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or ()]


def response_meta(kind: str, state: ServerState, reqs: list[Choice]) -> dict:
  """id, object, created, and the model: the LoRA adapter the request named, as vLLM
  answers, or the base's name."""
  prefix = 'chatcmpl' if kind.startswith('chat') else 'cmpl'
  return {'id': f'{prefix}-{uuid.uuid4().hex}', 'object': kind, 'created': int(time.time()),
          'model': reqs[0].adapter or state.model_name}


def include_usage(body: Body) -> bool:
  """include_usage, or vLLM's continuous_usage_stats (which vLLM gives with usage on)."""
  options = body.stream_options or {}
  return bool(options.get('include_usage') or options.get('continuous_usage_stats'))


def chunk_usage(body: Body, r: Choice) -> dict:
  """The usage member of a streamed chunk of choice r: absent unless include_usage; null,
  or with vLLM's continuous_usage_stats the choice's own tokens so far (as vLLM counts)."""
  if not include_usage(body):
    return {}
  if not body.stream_options.get('continuous_usage_stats'):
    return {'usage': None}
  prompt, completion = len(r.prompt_ids), len(r.token_ids)
  return {'usage': {'prompt_tokens': prompt, 'completion_tokens': completion,
                    'total_tokens': prompt + completion}}


def error_event(err: ApiError) -> str:
  # The openai client raises on a chunk with an "error" member: the stream's last word.
  return sse({**err.body(), 'status_code': err.status})


def prompt_scores(r: Choice) -> list:
  """The prompt's logprob entries ([None] + one per token after the first), from the
  choice that computed them."""
  return r.prompt_logprobs or r.first.prompt_logprobs or [None]


def vllm_prompt_logprobs(tokenizer, r: Choice) -> list:
  """vLLM's prompt_logprobs: None for the first token, then per token {id: {logprob,
  rank, decoded_token}} for the prompt's own token and the top N. Built once per prompt
  (its choices share it), each token decoded once."""
  if r.first.vllm_json is not None:
    return r.first.vllm_json
  text = functools.lru_cache(maxsize=None)(lambda token: token_text(tokenizer, token))
  out = [None]
  for e in prompt_scores(r)[1:]:
    item = {str(e.token_id): {'logprob': e.logprob, 'rank': e.rank,
                              'decoded_token': text(e.token_id)}}
    for rank, (token, logprob) in enumerate(e.top or (), 1):
      item.setdefault(str(token), {'logprob': logprob, 'rank': rank,
                                   'decoded_token': text(token)})
    out.append(item)
  r.first.vllm_json = out
  return out
