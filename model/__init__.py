"""The Llama-family transformer, written once with logical axis names."""

from model.config import ModelConfig
from model.transformer import (abstract_params, count_params, flops_per_token, forward,
                               init_params, logical_axes, logits, param_specs, summed_nll)
