"""Meshes and shardings: logical axis rules applied to parameters and batches."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from mhar_jax.layers.sharding import DEFAULT_RULES

AXES = ("data", "model")


def make_mesh(data: int, model: int, devices=None) -> Mesh:
  """A ``(data, model)`` mesh with Auto axes (GSPMD, logical-rule sharding)."""
  devices = devices if devices is not None else jax.devices()
  if data * model != len(devices):
    raise ValueError(f"mesh (data={data}, model={model}) needs {data * model}"
                     f" devices, got {len(devices)}.")
  return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto,) * 2,
                       devices=devices)


def _fit(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
  """Drops mesh axes from dimensions they do not divide (those replicate)."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    out.append(axes if names and dim % size == 0 else None)
  return PartitionSpec(*out)


def state_shardings(state, mesh: Mesh, rules=DEFAULT_RULES):
  """``NamedSharding`` for every leaf of an (abstract) NNX state, by the
  logical names in its ``out_sharding`` metadata and ``rules``."""
  with core_spmd.logical_axis_rules(rules):
    specs = nnx.get_partition_spec(state)
  return jax.tree.map(
      lambda spec, x: NamedSharding(mesh, _fit(spec, x.shape, mesh)),
      specs, state, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows over ``data``, the rest replicated."""
  return NamedSharding(mesh, PartitionSpec("data"))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
