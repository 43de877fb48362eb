"""Test set-up: 8 forced CPU devices (before JAX starts), float32 matmuls exact.

The CPU tests assume the CPU backend; on a GPU machine run only the `gpu` tests.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
