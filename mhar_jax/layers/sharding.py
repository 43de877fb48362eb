"""Logical axis names and the one table of rules that maps them onto a mesh.

Parameters and activations carry logical names (``"embed"``, ``"mlp"``,
``"activation_batch"`` ...). :data:`DEFAULT_RULES` maps them onto a mesh with
axes ``data`` and ``model``: parameters FSDP-style over ``data`` along the
embedding axis and tensor-parallel over ``model`` along heads / MLP / vocabulary;
activations batch-parallel over ``data``. Use the rules with
``flax.linen.logical_axis_rules`` (or ``flax.core.spmd.logical_axis_rules``)
around tracing; without rules or outside a mesh, :func:`constrain` is a no-op.
"""

from __future__ import annotations

import jax
from flax.core import spmd as core_spmd
from jax.sharding import NamedSharding, PartitionSpec

DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    # parameters
    ("vocab", "model"),
    ("embed", "data"),
    ("q_heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("mlp", "model"),
    ("norm", None),
    ("streams", None),
    # activations
    ("activation_batch", "data"),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "model"),
    ("activation_kv_heads", "model"),
    ("activation_mlp", "model"),
    ("activation_vocab", "model"),
    ("activation_streams", None),
)


def logical_to_spec(names, rules=None) -> PartitionSpec:
  """Maps a tuple of logical axis names to a mesh ``PartitionSpec``."""
  rules = dict(rules if rules is not None else core_spmd.get_logical_axis_rules())
  return PartitionSpec(*(rules.get(n) if n is not None else None for n in names))


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
  """``with_sharding_constraint`` by logical names, inside a mesh with rules.

  A no-op when no logical axis rules are set or no mesh is active, so modules
  run unchanged on one device.
  """
  rules = core_spmd.get_logical_axis_rules()
  mesh = jax.sharding.get_abstract_mesh()
  if not rules or mesh is None or mesh.empty:
    return x
  if len(names) != x.ndim:
    raise ValueError(f"constrain: {len(names)} names {names} for an array of"
                     f" shape {x.shape}.")
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, logical_to_spec(names, rules)))


BTD = ("activation_batch", "activation_length", "activation_embed")
