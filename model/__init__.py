"""The Llama-family transformer, written once with logical axis names."""

from model.config import ModelConfig
from model.transformer import (abstract_params, count_params, flops_per_token, forward,
                               forward_with_aux, summed_nll_and_aux,
                               init_params, logical_axes, logits, param_specs, summed_nll)
