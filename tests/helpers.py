"""Shared test helpers (importable from the test modules: pytest puts tests/ on sys.path)."""

import jax

from mhar_jax.config import validate


def make_trainer(cfg, workdir):
  """The real Trainer for ``cfg`` on one CPU device (conftest forces 8)."""
  from mhar_jax.train import Trainer, resolve_data
  m = validate(cfg, num_devices=1)
  return Trainer(cfg, m, str(workdir), resolve_data(cfg, m),
                 devices=jax.devices()[:1])
