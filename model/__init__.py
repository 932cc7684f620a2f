"""The Llama-family transformer, written once with logical axis names."""

from model.config import ModelConfig
from model.loss import summed_nll, summed_nll_and_aux
from model.transformer import (abstract_params, count_params, flops_per_token, forward,
                               forward_with_aux, init_params, logical_axes, logits,
                               param_specs)
