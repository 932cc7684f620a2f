"""The embedded default: a small byte-level GPT that trains on a 2-core CPU in minutes.

Data: the default corpus (Python standard library sources, built once and cached).
Variants: '' (the default run), 'tiny' (seconds; used by the tests).
"""

from training.config import Config

VARIANTS = ('', 'tiny')


def get_config(variant: str = '') -> Config:
  cfg = Config(steps=300, workdir='runs/default')
  m = cfg.model
  m.vocab_size, m.num_layers, m.embed_dim = 320, 4, 192   # 257 byte ids, padded
  m.num_heads, m.num_kv_heads, m.max_seq_len = 4, 2, 256
  cfg.data.seq_len, cfg.data.batch_size = 128, 16
  cfg.optim.learning_rate, cfg.optim.warmup_steps = 3e-3, 20
  cfg.checkpoint.every_steps = 100
  cfg.sample.num_tokens = 200
  if variant == 'tiny':
    m.num_layers, m.embed_dim, m.max_seq_len = 2, 64, 64
    cfg.data.seq_len, cfg.data.batch_size, cfg.data.corpus_max_mb = 32, 8, 1
    cfg.steps, cfg.checkpoint.every_steps, cfg.sample.num_tokens = 20, 10, 16
    cfg.workdir = 'runs/tiny'
  elif variant:
    raise ValueError(f'configs/default.py has variants "" and "tiny", not {variant!r}.')
  return cfg
