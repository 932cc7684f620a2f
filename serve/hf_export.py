"""A train.py run's model as a Hugging Face directory (model/hf.py's FAMILIES: the
architecture the run started from, model.hf_architecture, else the one its fields give),
for transformers, vLLM and `python -m serve --hf-model`.

  python -m serve.hf_export --checkpoint runs/default --output runs/default-hf
  python -m serve.hf_export --checkpoint runs/default --output DIR --dtype bfloat16
  python -m serve.hf_export --checkpoint runs/default --output DIR --max-shard-size 2GB
  python -m serve.hf_export --checkpoint runs/lora --output DIR           # a PEFT adapter
  python -m serve.hf_export --checkpoint runs/lora --output DIR --merge   # base + adapters

A LoRA run (a lora section in its config.json) exports its adapters as a PEFT adapter
directory (adapter_config.json, adapter_model.safetensors, float32; base_model_name_or_path
its init_from_hf directory), which peft loads onto the base; with --merge, the base with
the adapters merged in (W + scale * A @ B), as the directory below.

Writes config.json (a LlamaConfig computing what the run's model computes, a Qwen2Config
with q/k/v biases, a Qwen3Config with q/k norms, a MistralConfig for a run from a
Mistral; a MixtralConfig for a mixture of experts that Mixtral can express: every layer
routed, a softmax router, 2 or more experts a token, no shared experts; with q/k norms a
Qwen3MoeConfig; anything else refused),
model.safetensors (the weights of the newest intact checkpoint, checksums verified, in
--dtype; 'auto': the run's master-weight dtype, model.param_dtype, so nothing is
rounded; past --max-shard-size, 5GB by default, split by huggingface_hub into
model-0000k-of-0000n.safetensors files and model.safetensors.index.json, as
transformers' save_pretrained writes them), tokenizer.json (the run's own
tokenizer.json; the byte tokenizer as a byte-level BPE without merges, ids 0-255 the
bytes and 256 <|endoftext|>, so every id means what it meant in training),
tokenizer_config.json and generation_config.json (the end-of-document token).
The weights are gathered on the host, not on an accelerator. The directory is written
under a temporary name beside --output (`.NAME.*`) and renamed into place last: a failed
export leaves nothing (a killed one, that hidden directory), and an existing non-empty
--output is refused.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from model import lora
from model.hf import hf_config, hf_tensors, host_device
from model.lora_peft import peft_config, write_peft_adapter
from serve.load.checkpoint import load_checkpoint
from serve.load.lora_checkpoint import load_lora_checkpoint, lora_section
from serve.load.hf_model import SERVE_DTYPES, check_dtype
from training.tokenizer import bytes_to_unicode

BYTE_EOS_TOKEN = '<|endoftext|>'   # training.tokenizer.EOS_CANDIDATES' first: found again


def byte_tokenizer_json() -> str:
  """training.tokenizer.ByteTokenizer as a tokenizer.json: each byte its own token (its
  GPT-2 byte-level character, no merges) with id = the byte, then eos = 256."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  table = bytes_to_unicode()
  vocab = {table[b]: b for b in range(256)}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([BYTE_EOS_TOKEN])
  return tok.to_str(pretty=True)


def tokenizer_files(tokenizer) -> tuple[str, str]:
  """(tokenizer.json text, the end-of-document token's text) of a run's tokenizer."""
  if getattr(tokenizer, 'name', '') == 'byte':
    return byte_tokenizer_json(), BYTE_EOS_TOKEN
  with open(tokenizer.path, encoding='utf-8') as f:
    return f.read(), tokenizer.token_text(tokenizer.eos_id)


MAX_SHARD_SIZE = '5GB'   # huggingface_hub's default


def export(checkpoint: str, output: str, dtype: str = 'auto',
           max_shard_size: int | str = MAX_SHARD_SIZE, merge: bool = False) -> dict:
  """Writes the directory (see the module docstring); returns its config.json dict
  (adapter_config.json's for a PEFT adapter)."""
  output = os.path.abspath(os.path.expanduser(output))
  max_shard_size = shard_size(max_shard_size)
  if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
    raise FileExistsError(f'--output {output} exists and is not an empty directory: '
                          'choose a new one (nothing is overwritten).')
  lcfg = lora_section(checkpoint)
  if merge and lcfg is None:
    raise ValueError(f'--merge: {checkpoint} is a full-model run (no lora section in its '
                     'config.json), nothing to merge: export it without --merge.')
  if lcfg is not None and not merge:
    return _export_peft(checkpoint, output)
  # Onto the host (a model too big for one accelerator exports too), master values,
  # cast once with numpy.
  if lcfg is None:
    served = load_checkpoint(checkpoint, mesh=_host_mesh(), dtype='float32')
  else:
    run = load_lora_checkpoint(checkpoint, mesh=_host_mesh())
    served = dataclasses.replace(run.served, params=lora.merge(
        run.served.params, run.adapter, run.lcfg, run.served.model_cfg))
  cfg = served.model_cfg
  dtype = cfg.param_dtype if dtype == 'auto' else check_dtype(dtype)
  tokenizer_json, eos_token = tokenizer_files(served.tokenizer)
  config = hf_config(cfg, dtype, served.tokenizer.eos_id)
  tensors = {k: v.astype(jnp.dtype(dtype)) for k, v in hf_tensors(served.params,
                                                                  cfg).items()}
  _publish(output, lambda staging: _write(staging, config, tensors, tokenizer_json,
                                          eos_token, cfg.max_seq_len,
                                          served.tokenizer.eos_id, max_shard_size))
  return config


def _export_peft(checkpoint: str, output: str) -> dict:
  run = load_lora_checkpoint(checkpoint, mesh=_host_mesh())
  cfg = run.served.model_cfg
  _publish(output, lambda staging: write_peft_adapter(staging, run.adapter, run.lcfg, cfg,
                                                      run.base_source))
  return peft_config(run.lcfg, cfg, run.base_source)


def _publish(output: str, write) -> None:
  """write(directory) into a hidden directory beside `output`, renamed into place last."""
  parent = os.path.dirname(output)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(dir=parent, prefix=f'.{os.path.basename(output)}.')
  try:
    write(staging)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)   # as a plain mkdir and open would make them
    for name in os.listdir(staging):
      os.chmod(os.path.join(staging, name), 0o666 & ~umask)
    if os.path.isdir(output):
      os.rmdir(output)   # empty (checked above)
    os.rename(staging, output)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def _host_mesh():
  """A one-device mesh on the host's CPU (None: jax's default, where it has no CPU)."""
  host = host_device()
  return None if host is None else jax.make_mesh((1,), ('tensor',),
                                                 axis_types=(AxisType.Auto,), devices=[host])


_UNITS = {'': 1, 'B': 1, 'KB': 10**3, 'MB': 10**6, 'GB': 10**9, 'TB': 10**12,
          'KIB': 2**10, 'MIB': 2**20, 'GIB': 2**30, 'TIB': 2**40}


def shard_size(size: int | str) -> int:
  """Bytes in a --max-shard-size: an int, or a number and a unit ('500MB', '2.5GB': powers
  of 1000 as transformers reads them; '4GiB': of 1024); ValueError otherwise."""
  match = re.fullmatch(r'\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*', str(size))
  unit = match and match.group(2).upper()
  if not match or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
    raise ValueError(f'--max-shard-size {size!r}: give a positive size in bytes or with a '
                     'unit, such as 500MB, 5GB or 4GiB.')
  return int(float(match.group(1)) * _UNITS[unit])


def _write(directory, config, tensors, tokenizer_json, eos_token, max_len, eos_id,
           max_shard_size: int | str = MAX_SHARD_SIZE) -> None:
  from huggingface_hub import split_state_dict_into_shards_factory  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  def dump(name, value):
    with open(os.path.join(directory, name), 'w', encoding='utf-8') as f:
      f.write(value if isinstance(value, str) else json.dumps(value, indent=2) + '\n')

  dump('config.json', config)
  dump('generation_config.json', {'eos_token_id': eos_id})
  dump('tokenizer.json', tokenizer_json)
  dump('tokenizer_config.json', {
      'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': eos_token,
      'bos_token': None, 'model_max_length': max_len,
      'clean_up_tokenization_spaces': False})
  # Largest tensors first into files of at most max_shard_size (a larger tensor alone in
  # its own), named as transformers names them; one file is model.safetensors.
  split = split_state_dict_into_shards_factory(
      tensors, get_storage_size=lambda a: a.nbytes,
      filename_pattern='model{suffix}.safetensors', max_shard_size=shard_size(max_shard_size))
  for filename, names in split.filename_to_tensors.items():
    save_file({name: tensors[name] for name in names}, os.path.join(directory, filename),
              metadata={'format': 'pt'})   # transformers asks for it
  if split.is_sharded:
    dump('model.safetensors.index.json', {'metadata': split.metadata,
                                          'weight_map': split.tensor_to_filename})


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m serve.hf_export', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoint', required=True, metavar='WORKDIR',
                      help="a train.py run's workdir (its --config.workdir)")
  parser.add_argument('--output', required=True, metavar='DIR',
                      help='the Hugging Face directory to create (new or empty)')
  parser.add_argument('--dtype', default='auto', choices=('auto', *SERVE_DTYPES),
                      help="the weights' dtype; auto: the run's model.param_dtype")
  parser.add_argument('--max-shard-size', default=MAX_SHARD_SIZE, metavar='SIZE',
                      help='split the weights into files of at most SIZE (bytes, or 500MB, '
                           '5GB, 4GiB) with model.safetensors.index.json; default %(default)s')
  parser.add_argument('--merge', action='store_true',
                      help='a LoRA run: write the base with the adapters merged in (default: '
                           'a PEFT adapter directory)')
  args = parser.parse_args(argv)
  try:
    shard_size(args.max_shard_size)   # a bad size is told before the checkpoint is read
    config = export(args.checkpoint, args.output, args.dtype, args.max_shard_size, args.merge)
  except (ValueError, FileNotFoundError, FileExistsError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if config.get('peft_type'):
    print(f'wrote {os.path.abspath(args.output)}: a PEFT LoRA adapter, rank {config["r"]} on '
          f'{", ".join(config["target_modules"])}', file=sys.stderr)
    return 0
  print(f'wrote {os.path.abspath(args.output)}: {config["architectures"][0]}, '
        f'{config["num_hidden_layers"]} layers, hidden {config["hidden_size"]}, vocab '
        f'{config["vocab_size"]}, {config["torch_dtype"]}', file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
