"""The docs' generated reference pages: config fields from the config dataclasses' field
docstrings, server and batch CLI flags from their argument parsers, the Hugging Face
architectures from model/hf.py's FAMILIES.

Sphinx calls `fill_page` on every page it reads (docs/conf.py); a page holding a marker
`<!-- generated: NAME -->` gets NAME's table in its place, so the tables are never written
by hand. `python docs/gen_reference.py NAME` prints one (config, serve-flags,
generate-flags, architectures).
"""

import argparse
import dataclasses
import json
import os
import re
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Flags their parsers give no help (the engine's are made from serve.config.ServeConfig's
# fields without it): their meanings are written here, once. The build fails if a flag has
# neither help nor a line here, or a line names a flag its parser lacks.
SERVE_MEANINGS = {
    '--port': 'port to bind',
    '--log-level': "the server's log level (uvicorn's)",
    '--block-size': 'tokens per KV block',
    '--num-blocks': 'KV blocks; 0: from `--memory-fraction` (on CPU capped at '
                    '`--max-num-seqs` full-length requests)',
    '--memory-fraction': 'of the device memory the weights leave, for the KV cache',
    '--max-num-seqs': 'requests in the running batch',
    '--max-num-batched-tokens': 'tokens per step (prefill chunks and decodes together)',
    '--max-model-len': "prompt + output tokens; 0: the model's context",
    '--attention': 'paged attention: `pallas` (the kernel; GPU default) or `xla` (CPU '
                   'default, memory bounded per block of keys, not per context)',
    '--dtype': "weights, activations and KV cache: `float32`, `bfloat16` or `float16`; "
               "auto: the model's (a Hugging Face directory's config.json `dtype`; a "
               "`train.py` run's `model.dtype`, its float32 master weights checked, then "
               'cast)',
    '--kv-cache-dtype': "KV pages: auto (`--dtype`'s), or 8-bit with a float32 scale per "
                        'token and kv head: `int8`, `fp8` (= `fp8_e4m3`) or `fp8_e5m2`, '
                        'about twice the tokens in the same memory '
                        '([8-bit KV cache](../serving/kv-cache.md))',
    '--quantization': 'the layers\' weights stored 8-bit, one scale per output channel, '
                      'dequantized beside each matmul: `int8` or `fp8` (e4m3); `none`: as '
                      'loaded. A compressed-tensors checkpoint is quantized already: give '
                      'none ([quantized serving](../serving/quantization.md))',
    '--tensor': 'devices the heads and KV pages are split over',
    '--enable-prefix-caching': 'reuse the KV blocks of shared prompt prefixes',
    '--max-waiting-requests': 'queue bound; beyond it the server answers 429',
    '--warmup': "compile every step shape, and the sampler (greedy, sampled, top_p and the "
                "model's generation_config defaults, each plain, with structured output, "
                'and with logprobs with and without top logprobs) before serving (no stall '
                'on a new batch shape; a batch with another top_k, penalties, logit_bias or '
                'bans, logprobs beside structured output, or mixing kinds of rows, compiles '
                'its sampler variant on first use, penalties once per power-of-two history '
                'length)',
    '--seed': 'draws the seeds of requests that give none',
    '--speculative-config': "speculative decoding: vLLM's JSON object, "
                            '`{"method": "ngram", "num_speculative_tokens": 4}` '
                            '([speculative decoding](../serving/speculative.md))',
    '--generation-config': 'auto: sampling fields a request leaves out (`temperature`, '
                           '`top_p`, `top_k`, `min_p`, `repetition_penalty`) take the '
                           "values the Hugging Face directory's generation_config.json sets "
                           "apart from transformers' defaults, as vLLM reads it (printed at "
                           "start; its `max_new_tokens` is not used); none: OpenAI's "
                           'defaults',
    '--enable-lora': 'serve LoRA adapters, picked per request by `model` '
                     '([LoRA adapters](../serving/lora.md))',
    '--max-loras': 'LoRA adapters in one batch (device slots)',
    '--max-cpu-loras': 'LoRA adapters loaded in host memory at once (0: --max-loras)',
    '--max-lora-rank': 'the largest rank a LoRA adapter may have (slots are padded to it)',
}
GENERATE_MEANINGS = {
    '--prompts': 'the requests, one JSON object a line ([batch CLI](../serving/batch.md))',
    '--output': 'the completions, one JSON line per request, in input order',
}
# Defaults read from the environment are not printed (a key would land in the site).
FROM_ENVIRONMENT = {'api_key': '`MESHLM_API_KEY` if set'}


def _cell(text) -> str:
  text = str(text).replace('|', '\\|').replace('\n', ' ')
  return text.replace('<', '&lt;').replace('*', '\\*')


def config_reference() -> str:
  """One table per section of training.config.Config: field, type, default, meaning."""
  # pylint: disable=import-outside-toplevel
  from training import config as config_lib, describe
  out = []
  for name, section in describe.sections(config_lib.Config()):
    prefix = '' if name == 'top level' else f'{name}.'
    title = 'Top level' if name == 'top level' else f'`{name}`'
    doc = describe.inspect.getdoc(type(section)).splitlines()[0]
    out += [f'## {title}', '', doc, '', '| field | type | default | meaning |',
            '|---|---|---|---|']
    docs = describe.field_docs(type(section))
    for field in dataclasses.fields(section):
      value = getattr(section, field.name)
      if dataclasses.is_dataclass(value):
        continue
      kind = getattr(field.type, '__name__', str(field.type))
      out.append(f'| `{prefix}{field.name}` | {kind} | `{value!r}` | '
                 f'{_cell(docs.get(field.name, ""))} |')
    out.append('')
  return '\n'.join(out)


class _Parser(Exception):
  """Carries the parser a CLI's parse_args built, before it parses anything."""


def built_parser(parse_args) -> argparse.ArgumentParser:
  """The parser `parse_args` builds (it builds and parses in one call)."""
  def grab(self, *args, **kwargs):
    raise _Parser(self)
  with mock.patch.object(argparse.ArgumentParser, 'parse_args', grab):
    try:
      parse_args([])
    except _Parser as caught:
      return caught.args[0]
  raise RuntimeError(f'{parse_args} built no argparse parser')


def _meaning(action: argparse.Action, meanings: dict[str, str]) -> str:
  flag = action.option_strings[-1].replace('--no-', '--')
  text = action.help or meanings.get(flag)
  if not text:
    raise ValueError(f'{flag} has no help in its parser and no line in '
                     'docs/gen_reference.py: write its meaning there once.')
  if '%(' in text:
    text = text % {**vars(action), 'default': action.default}
  if action.choices:
    text += f' (one of {", ".join(map(str, action.choices))})'
  return text


def _default(action: argparse.Action) -> str:
  if action.dest in FROM_ENVIRONMENT:
    return FROM_ENVIRONMENT[action.dest]
  if action.required:
    return 'required'
  if action.default is None or action.default == '':
    return ''
  if isinstance(action, argparse.BooleanOptionalAction):
    return 'on' if action.default else 'off'
  return 'off' if action.default is False else f'`{action.default}`'


def flag_table(parser: argparse.ArgumentParser, meanings: dict[str, str], skip=(),
               level: str = '##') -> str:
  """One table per argument group (a heading of `level`): flag, default, meaning."""
  out, seen = [], set()
  for group in parser._action_groups:   # pylint: disable=protected-access
    actions = [a for a in group._group_actions   # pylint: disable=protected-access
               if a.option_strings and a.dest != 'help' and a.dest not in skip]
    if not actions:
      continue
    title = {'options': 'model and general', 'optional arguments': 'model and general'}.get(
        group.title, group.title)
    out += [f'{level} {title}', '', '| flag | default | meaning |', '|---|---|---|']
    for action in actions:
      seen.add(action.option_strings[-1].replace('--no-', '--'))
      flags = ' / '.join(f'`{f}`' for f in action.option_strings)
      out.append(f'| {flags} | {_default(action)} | {_cell(_meaning(action, meanings))} |')
    out.append('')
  unknown = set(meanings) - seen
  if unknown:
    raise ValueError(f'docs/gen_reference.py ENGINE_MEANINGS names flags the parser lacks: '
                     f'{sorted(unknown)}; remove them.')
  return '\n'.join(out)


def serve_flags() -> str:
  from serve import __main__ as server   # pylint: disable=import-outside-toplevel
  return flag_table(built_parser(server.parse_args), SERVE_MEANINGS)


def generate_flags() -> str:
  """The batch CLI's own flags (its engine flags are the server's)."""
  # pylint: disable=import-outside-toplevel
  from serve import config as serve_config, generate
  engine = {a.dest for a in serve_config.add_engine_args(argparse.ArgumentParser())._actions}
  return flag_table(built_parser(generate.parse_args), GENERATE_MEANINGS, skip=engine,
                    level='###')


def architectures() -> str:
  """One row per architecture model/hf.py reads and writes: the model fields it sets and
  what of it is refused; then what every one refuses."""
  from model import hf   # pylint: disable=import-outside-toplevel
  out = ['| architecture | `model_type` | train (`init_from_hf`) | serve (`--hf-model`) | '
         'export (`serve.hf_export`) | model fields | refused |', '|---|---|---|---|---|---|---|']
  for arch, family in hf.FAMILIES.items():
    fields = [f'`model.{k}={v}`' for k, v in family.fields.items()]
    if family.experts:
      fields.append('experts: `model.num_experts`, `model.experts_per_token`, '
                    '`model.moe_every`, `model.moe_mlp_dim`, `model.router_norm_topk`')
    refused = [f'{k} other than {json.dumps(v)}' for k, v in family.required.items()]
    refused += [family.refused] if family.refused else []
    out.append(f'| `{arch}` | `{family.model_type}` | yes | yes | yes | '
               f'{", ".join(fields) or "-"} | {_cell("; ".join(refused) or "-")} |')
  out += ['', f'Refused in every architecture: {_cell("; ".join(hf.REFUSED_EVERYWHERE))}.']
  return '\n'.join(out)


GENERATORS = {'config': config_reference, 'serve-flags': serve_flags,
              'generate-flags': generate_flags, 'architectures': architectures}


def fill_page(app, docname, source) -> None:   # pylint: disable=unused-argument
  """Sphinx's source-read hook: each `<!-- generated: NAME -->` becomes NAME's table."""
  for name, generate in GENERATORS.items():
    marker = f'<!-- generated: {name} -->'
    if marker in source[0]:
      source[0] = source[0].replace(marker, generate())
  left = re.search(r'<!-- generated: (.*?) -->', source[0])
  if left:
    raise ValueError(f'docs/{docname}.md asks for generated {left.group(1)!r}; '
                     f'docs/gen_reference.py makes {sorted(GENERATORS)}.')


if __name__ == '__main__':
  print(GENERATORS[sys.argv[1]]())
