"""examples/nnx_lm.py, a decoder LM written in Flax NNX, on the default corpus:
`python train.py --config=nnx_lm.py` (docs/own_model.md)."""

from training.config import Config

VARIANTS = ('',)


def get_config(variant: str = '') -> Config:
  if variant:
    raise ValueError(f'configs/nnx_lm.py has the variant "", not {variant!r}.')
  cfg = Config(steps=200, workdir='runs/nnx_lm', seed=0)
  cfg.model.module, cfg.model.loss = 'examples.nnx_lm:DecoderLM', 'examples.nnx_lm:loss'
  cfg.model.kwargs = {'vocab': 320, 'dim': 128, 'depth': 2, 'heads': 4, 'mlp': 512,
                      'max_len': 128}
  cfg.data.seq_len, cfg.data.batch_size = 128, 16   # byte-level default corpus
  cfg.optim.learning_rate, cfg.optim.warmup_steps = 3e-3, 20
  cfg.sample.num_tokens = 0
  return cfg
