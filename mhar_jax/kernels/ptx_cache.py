"""A disk cache for the PTX that jax-triton compiles while lowering.

jax-triton turns each Triton kernel specialisation into PTX (TTIR -> TTGIR ->
LLVM IR -> PTX) every time a process lowers a ``triton_call``, and keeps the
result in memory only. JAX's persistent compilation cache cannot skip that
work: its key is the lowered module, which holds the PTX. So every process
that starts a model with the routing kernels (a training run, a restart, each
host of a multi-host job) pays for the Triton compiles again.

:func:`cached` wraps jax-triton's compile function (``compile_ttir_inplace``)
with a cache of its results on disk, one JSON file per specialisation in
``<cache_dir>/mhar_jax_ptx``, where ``cache_dir`` is JAX's persistent
compilation cache directory (``jax_compilation_cache_dir``, e.g. the
environment variable ``JAX_COMPILATION_CACHE_DIR``): where JAX caches
executables, the PTX is cached beside them; where it does not, nothing is
written. The key is a SHA-256 of everything the PTX depends on: the TTIR text
(the kernel after specialisation, constexprs included), the compile options
(warps, stages, PTX version, libraries, ...), the compute capability and the
Triton and jax-triton versions. Only CUDA results are cached (for ROCm
jax-triton hands over a temporary file's path, not the code).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any, Callable

SUBDIR = "mhar_jax_ptx"


def key(ttir_text: str, options: Any, compute_capability: Any,
        versions: tuple) -> str:
  """SHA-256 hex digest of one Triton compile's inputs (see module doc)."""
  text = repr((ttir_text, repr(options), repr(compute_capability), versions))
  return hashlib.sha256(text.encode()).hexdigest()


def cached(compile_fn: Callable, result_cls: type,
           cache_dir: Callable[[], str | None], versions: tuple) -> Callable:
  """``compile_fn`` (jax-triton's ``compile_ttir_inplace(ttir, backend,
  options, compute_capability, platform)``, returning ``result_cls(binary,
  name, shared_mem_bytes, ttgir, llir)``) with results cached on disk.

  ``cache_dir()`` is read at each call: None or "" caches nothing. A missing,
  unreadable or corrupt entry is compiled again and rewritten; a failed write
  leaves the compile's result as it is. Entries are written to a temporary
  file and renamed into place, so concurrent processes never read half a file.
  The cached result has ``ttgir`` and ``llir`` None: jax-triton keeps them
  only to write into its dump directory, so ``cache_dir()`` must give None
  while that is set (``triton_route._ptx_cached`` does).
  """
  def compile_ttir(ttir, backend, options, compute_capability, platform):
    root = cache_dir()
    if not root or platform != "cuda":
      return compile_fn(ttir, backend, options, compute_capability, platform)
    folder = os.path.join(root, SUBDIR)
    # The compile transforms ``ttir`` in place: key it first.
    path = os.path.join(
        folder, key(str(ttir), options, compute_capability, versions) + ".json")
    try:
      with open(path) as f:
        entry = json.load(f)
      return result_cls(binary=entry["binary"], name=entry["name"],
                        shared_mem_bytes=int(entry["shared_mem_bytes"]),
                        ttgir=None, llir=None)
    except (OSError, ValueError, KeyError, TypeError):
      pass
    result = compile_fn(ttir, backend, options, compute_capability, platform)
    tmp = None
    try:
      os.makedirs(folder, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
      with os.fdopen(fd, "w") as f:
        json.dump({"binary": result.binary, "name": result.name,
                   "shared_mem_bytes": result.shared_mem_bytes}, f)
      os.replace(tmp, path)
    except OSError:
      if tmp is not None and os.path.exists(tmp):
        os.unlink(tmp)
    return result

  compile_ttir.__wrapped__ = compile_fn
  return compile_ttir
