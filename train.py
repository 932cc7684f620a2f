"""Train a model: `python train.py --config=NAME.py[:variant] --config.a.b=value`.

Bare config names are looked up in configs/; the default is configs/default.py.
"""

from training.cli import run

if __name__ == '__main__':
  run()
