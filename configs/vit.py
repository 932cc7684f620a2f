"""examples/vit.py, a Flax NNX vision transformer, on synthetic images:
`python train.py --config=vit.py` (docs/own_model.md)."""

from training.config import Config

VARIANTS = ('',)


def get_config(variant: str = '') -> Config:
  if variant:
    raise ValueError(f'configs/vit.py has the variant "", not {variant!r}.')
  cfg = Config(steps=60, workdir='runs/vit', seed=0)
  cfg.model.module, cfg.model.loss = 'examples.vit:ViT', 'examples.vit:loss'
  cfg.model.kwargs = {'image': 16, 'patch': 4, 'dim': 64, 'depth': 2, 'heads': 4,
                      'mlp': 128, 'classes': 8}
  cfg.rules = {'classes': 'vocab'}
  cfg.data.source = 'examples.vit:synthetic_batch'
  cfg.data.batch_size = 32
  cfg.optim.learning_rate, cfg.optim.warmup_steps = 3e-3, 5
  cfg.sample.num_tokens = 0
  cfg.checkpoint.every_steps = 50
  return cfg
