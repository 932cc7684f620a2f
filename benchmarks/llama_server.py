"""llama.cpp's own server as a throughput peer: the same HF weights converted to GGUF,
served by `llama-server` on 127.0.0.1, the requests sent concurrently as token ids.

Neither is installed by this project: build them from llama.cpp's source (shipped inside
`llama-cpp-python`'s sdist: `pip download llama-cpp-python --no-binary :all: --no-deps`)
with cmake (`--target llama-server`); the converter is `convert_hf_to_gguf.py` at the
source's top, run with the source's own `gguf-py` on the path. The benchmark names both
(--llama-server, --llama-converter) and skips this peer with a note when they are absent.
"""

import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

# The benchmark's tokenizer is a WordLevel one that the converter's checks do not know;
# the peer gets token ids, never text, so a BPE vocabulary of the same ids with one
# merge (llama.cpp refuses a BPE vocabulary without merges) will do.
_CONVERT = """
import sys
src, argv = sys.argv[1], sys.argv[2:]
sys.path[:0] = [src, src + '/gguf-py']
import conversion.base, conversion.llama


def set_vocab(self):
  self._set_vocab_gpt2()
  self.gguf_writer.add_token_merges(['w 4'])


conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'
conversion.llama.LlamaModel.set_vocab = set_vocab
sys.argv = ['convert_hf_to_gguf.py'] + argv
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def missing(server: str | None, converter: str | None) -> str | None:
  """Why the peer cannot run (a note for the JSON), or None when it can."""
  if not server or not converter:
    return 'not run: give --llama-server and --llama-converter to compare with llama.cpp'
  for flag, path in (('--llama-server', server), ('--llama-converter', converter)):
    if not os.path.isfile(path):
      return f'not run: {flag}={path} does not exist'
  return None


def convert(converter: str, hf_dir: str, out_path: str, dtype: str) -> None:
  """The HF directory's weights as one GGUF file in `dtype` ('float32': f32)."""
  outtype = {'float32': 'f32', 'bfloat16': 'bf16', 'float16': 'f16'}[dtype]
  src = os.path.dirname(os.path.abspath(converter))
  subprocess.run([sys.executable, '-c', _CONVERT, src, hf_dir, '--outfile', out_path,
                  '--outtype', outtype], check=True, capture_output=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def serve(server: str, gguf: str, *, slots: int, threads: int, slot_len: int,
          start_timeout_s: float = 300.0):
  """llama-server on the GGUF, `slots` parallel sequences of up to slot_len tokens each,
  `threads` threads; yields its base URL and is always stopped."""
  port = _free_port()
  # Its log goes to a file: a pipe nobody drains fills up and then blocks the server.
  log = tempfile.TemporaryFile()
  cmd = [server, '-m', gguf, '--host', '127.0.0.1', '--port', str(port), '-np', str(slots),
         '-t', str(threads), '-tb', str(threads), '-c', str(slots * slot_len)]
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
  try:
    url = f'http://127.0.0.1:{port}'
    _wait_healthy(proc, url, log, start_timeout_s)
    yield url
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
    log.close()


def _wait_healthy(proc, url: str, log, timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      log.seek(0)
      raise RuntimeError(f'llama-server exited with {proc.returncode}: '
                         f'{log.read().decode(errors="replace")[-2000:]}')
    try:
      with urllib.request.urlopen(f'{url}/health', timeout=5) as r:
        if r.status == 200:
          return
    except (urllib.error.URLError, ConnectionError, TimeoutError):
      pass
    time.sleep(0.5)
  raise RuntimeError(f'llama-server did not answer /health within {timeout_s:.0f} s')


def complete(url: str, prompt: list[int], num_tokens: int) -> list[int]:
  """Greedy, exactly num_tokens tokens (eos ignored), no prompt cache: the passes repeat
  the same prompts and must not find them cached."""
  body = {'prompt': prompt, 'n_predict': num_tokens, 'temperature': 0.0, 'top_k': 1,
          'ignore_eos': True, 'cache_prompt': False, 'return_tokens': True, 'stream': False}
  request = urllib.request.Request(f'{url}/completion', data=json.dumps(body).encode(),
                                   headers={'Content-Type': 'application/json'})
  with urllib.request.urlopen(request, timeout=600) as r:
    tokens = json.load(r)['tokens']
  if len(tokens) != num_tokens:
    raise RuntimeError(f'llama-server gave {len(tokens)} tokens, asked for {num_tokens}')
  return tokens


def time_requests(url: str, prompts, out_lens, concurrency: int) -> tuple[float, list]:
  """Every request sent at once, at most `concurrency` in flight (the server's slots)."""
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    start = time.perf_counter()
    outputs = list(pool.map(lambda a: complete(url, *a), zip(prompts, out_lens)))
    return time.perf_counter() - start, outputs
