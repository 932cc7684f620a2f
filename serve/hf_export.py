"""A train.py run's model as a Hugging Face Llama (or Mixtral) directory, for
transformers, vLLM and `python -m serve --hf-model`.

  python -m serve.hf_export --checkpoint runs/default --output runs/default-hf
  python -m serve.hf_export --checkpoint runs/default --output DIR --dtype bfloat16

Writes config.json (a LlamaConfig computing what the run's model computes; a
MixtralConfig for a mixture of experts that Mixtral can express: every layer routed, a
softmax router, 2 or more experts a token, no shared experts; anything else refused),
model.safetensors (the weights of the newest intact checkpoint, checksums verified, in
--dtype; 'auto': the run's master-weight dtype, model.param_dtype, so nothing is
rounded), tokenizer.json (the run's own tokenizer.json; the byte tokenizer as a
byte-level BPE without merges, ids 0-255 the bytes and 256 <|endoftext|>, so every id
means what it meant in training), tokenizer_config.json and generation_config.json (the
end-of-document token).
The weights are gathered on the host, not on an accelerator. The directory is written
under a temporary name beside --output (`.NAME.*`) and renamed into place last: a failed
export leaves nothing (a killed one, that hidden directory), and an existing non-empty
--output is refused.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from model.hf import hf_config, hf_tensors, host_device
from serve.hf_llama import SERVE_DTYPES, check_dtype
from serve.loader import load_checkpoint
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


def export(checkpoint: str, output: str, dtype: str = 'auto') -> dict:
  """Writes the directory (see the module docstring); returns its config.json dict."""
  output = os.path.abspath(os.path.expanduser(output))
  if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
    raise FileExistsError(f'--output {output} exists and is not an empty directory: '
                          'choose a new one (nothing is overwritten).')
  # Onto the host (a model too big for one accelerator exports too), master values,
  # cast once with numpy.
  served = load_checkpoint(checkpoint, mesh=_host_mesh(), dtype='float32')
  cfg = served.model_cfg
  dtype = cfg.param_dtype if dtype == 'auto' else check_dtype(dtype)
  tokenizer_json, eos_token = tokenizer_files(served.tokenizer)
  config = hf_config(cfg, dtype, served.tokenizer.eos_id)
  tensors = {k: v.astype(jnp.dtype(dtype)) for k, v in hf_tensors(served.params,
                                                                  cfg).items()}
  parent = os.path.dirname(output)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(dir=parent, prefix=f'.{os.path.basename(output)}.')
  try:
    _write(staging, config, tensors, tokenizer_json, eos_token, cfg.max_seq_len,
           served.tokenizer.eos_id)
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
  return config


def _host_mesh():
  """A one-device mesh on the host's CPU (None: jax's default, where it has no CPU)."""
  host = host_device()
  return None if host is None else jax.make_mesh((1,), ('tensor',),
                                                 axis_types=(AxisType.Auto,), devices=[host])


def _write(directory, config, tensors, tokenizer_json, eos_token, max_len, eos_id) -> None:
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
  save_file(tensors, os.path.join(directory, 'model.safetensors'),
            metadata={'format': 'pt'})   # transformers asks for it


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m serve.hf_export', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoint', required=True, metavar='WORKDIR',
                      help="a train.py run's workdir (its --config.workdir)")
  parser.add_argument('--output', required=True, metavar='DIR',
                      help='the Hugging Face directory to create (new or empty)')
  parser.add_argument('--dtype', default='auto', choices=('auto', *SERVE_DTYPES),
                      help="the weights' dtype; auto: the run's model.param_dtype")
  args = parser.parse_args(argv)
  try:
    config = export(args.checkpoint, args.output, args.dtype)
  except (ValueError, FileNotFoundError, FileExistsError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'wrote {os.path.abspath(args.output)}: {config["architectures"][0]}, '
        f'{config["num_hidden_layers"]} layers, hidden {config["hidden_size"]}, vocab '
        f'{config["vocab_size"]}, {config["torch_dtype"]}', file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
