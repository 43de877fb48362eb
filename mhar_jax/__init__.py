"""mhar_jax: Multi-Head Attention Residuals in JAX / Flax NNX."""

__version__ = "0.1.0"
