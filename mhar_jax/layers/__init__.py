"""Flax NNX modules: building blocks, depth routers and the decoder.

They know nothing of training: build one with ``nnx.Rngs`` and call it.
"""

from mhar_jax.layers.basic import Attention, RMSNorm, SwiGLU, apply_rope
from mhar_jax.layers.router import (DepthRouter, HyperConnection,
                                    block_boundaries, mean_entropy)
from mhar_jax.layers.sharding import DEFAULT_RULES, constrain, logical_to_spec
from mhar_jax.layers.transformer import (RESIDUALS, ROUTED, Transformer,
                                         TransformerConfig, count_params)

__all__ = ["Attention", "DEFAULT_RULES", "DepthRouter", "HyperConnection",
           "RESIDUALS", "ROUTED", "RMSNorm", "SwiGLU", "Transformer",
           "TransformerConfig", "apply_rope", "block_boundaries", "constrain",
           "count_params", "logical_to_spec", "mean_entropy"]
