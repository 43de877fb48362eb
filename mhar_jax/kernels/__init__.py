"""Functional core: depth routing, with one entry point and a pure-jnp reference.

``route`` computes multi-head depth routing (DESIGN.md §1) and picks an
implementation: the Triton kernels on a CUDA backend when jax-triton imports,
the pure-jnp reference (:mod:`mhar_jax.kernels.reference`) everywhere else.
Both compute the same function; ``impl`` forces one.
"""

from __future__ import annotations

import functools

import jax

from mhar_jax.kernels import reference
from mhar_jax.kernels.reference import Sources, inv_rms, routing_weights

IMPLS = ("auto", "reference", "triton")

__all__ = ["IMPLS", "Sources", "inv_rms", "reference", "resolve_impl", "route",
           "routing_weights"]


@functools.cache
def _triton_available() -> bool:
  if jax.default_backend() != "gpu":
    return False
  try:
    from mhar_jax.kernels import triton_route  # noqa: F401  (imports jax_triton)
  except ImportError:
    return False
  return True


def resolve_impl(impl: str | None) -> str:
  """Maps ``None``/``"auto"`` to the implementation ``route`` would use here."""
  impl = impl or "auto"
  if impl not in IMPLS:
    raise ValueError(f"routing impl={impl!r} is not one of {IMPLS}.")
  if impl == "auto":
    return "triton" if _triton_available() else "reference"
  if impl == "triton" and not _triton_available():
    raise ValueError(
        "routing impl='triton' needs a CUDA backend with triton and jax-triton"
        " installed (pip install 'mhar_jax[gpu]'); use impl='reference' or"
        " 'auto' on this machine.")
  return impl


def route(sources: Sources, query: jax.Array, norm_scale: jax.Array, *,
          num_heads: int, eps: float = 1e-6, impl: str | None = None
          ) -> jax.Array:
  """Multi-head depth routing of S sources into one ``[..., D]`` vector.

  Args:
    sources: ``[S, ..., D]`` or a sequence of S arrays ``[..., D]``. Passing a
      list avoids copying a growing history into one array at every site.
    query: ``[D]`` pseudo-query (zeros give the uniform mean of the sources).
    norm_scale: ``[D]`` RMSNorm gain of the keys.
    num_heads: H, dividing D; each head routes its ``D/H`` contiguous channels
      with its own softmax over sources. ``num_heads=1`` is AttnRes.
    eps: RMSNorm epsilon of the keys.
    impl: ``"auto"`` (default), ``"reference"`` or ``"triton"``.

  Returns:
    ``[..., D]`` in the sources' dtype (norms, logits, softmax and
    accumulation in float32).
  """
  if resolve_impl(impl) == "triton":
    from mhar_jax.kernels import triton_route
    return triton_route.route(sources, query, norm_scale, num_heads=num_heads,
                              eps=eps)
  return reference.route(sources, query, norm_scale, num_heads=num_heads,
                         eps=eps)
