"""Compile for one H200 on a machine without a GPU (XLA's deviceless compile).

    import h200_aot                  # before anything else imports jax
    devices = h200_aot.setup()       # one H200 "device" to build a mesh on
    ... jax.jit(f).lower(...).compile().memory_analysis()

What XLA compiles here is what it would compile on the GPU machine (same
jax / jaxlib, same CUDA target, sm_90, 132 SMs), except for autotuning, which
needs the device: memory analysis, buffer assignment, rematerialization and
the HLO schedule can be studied without device time. ``setup`` makes the
library take its GPU paths as on the device (the Triton routing kernels,
cuDNN attention) by answering "gpu" for ``jax.default_backend()`` and sm_90
for jax-triton's compute-capability query.

Needs Python >= 3.12 with the CUDA plugin of the device's jax (no GPU or
driver), e.g. as session 14 made it::

    python3.12 -m venv /tmp/venvaot && . /tmp/venvaot/bin/activate
    pip install "jax[cuda13]==0.11.2" triton==3.6.0 \
        ../shared/wheels/gpu-py312/{jax_triton,grain,array_record}-*.whl
    pip install -e . && pip install flax optax orbax-checkpoint chex \
        ml_collections tensorboard tokenizers safetensors matplotlib
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python benchmarks/peak_buffers.py \
        --deviceless --runs 1b/prenorm,1b/mhar

``pool_bytes`` stands for the memory pool the GPU client gives XLA
(``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card): it sets the limit XLA's
rematerialization squeezes the program towards (~0.76 of it here). With that
pass off (``--xla_disable_hlo_passes=rematerialization``, as the throughput
benchmark compiles) the pool does not matter. How close these plans are to
the device's own (whose autotuner may pick other fusions) is checked by the
throughput table's "XLA GiB" column beside the measured peak. Without
autotuning XLA compiles the GEMMs as its Triton fusions; on an H100 the
autotuner chose cuBLAS for them, and the plans then part by up to ~1 GiB at a
131k-token microbatch, either way (``+xla.xla_gpu_enable_triton_gemm=false``
compiles cuBLAS here: Block 100m 31.46 -> 32.31 GiB against the device's
32.40, but full 100m 31.73 -> 33.79 against 31.7; benchmarks/RESULTS.md,
session 39).
"""

from __future__ import annotations

import os
import sys

H200_BYTES = 143771 * 2**20          # nvidia-smi's memory.total

_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 62914560
  clock_rate_ghz: 1.98
  device_memory_size: %d
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""


def setup(pool_bytes: int | None = None):
  """Makes this process compile for one H200; returns its device (a list).

  Must run before jax is imported. ``pool_bytes`` defaults to
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (else 0.75, JAX's default) of the card.
  """
  if "jax" in sys.modules:
    raise RuntimeError("h200_aot.setup() must run before jax is imported")
  os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"   # no driver to check
  os.environ["JAX_PLATFORMS"] = "cpu"                   # no CUDA client
  if pool_bytes is None:
    frac = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    pool_bytes = int(frac * H200_BYTES)
  import jax
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(
      platform="cuda", target_config=_TARGET % pool_bytes, topology="1x1x1")
  jax.default_backend = lambda: "gpu"
  try:
    import jax_triton.triton_lib as triton_lib
    triton_lib.triton_kernel_call_lib.get_compute_capability = lambda _: 90
  except ImportError:
    pass   # the library then routes with the jnp reference, as it would
  return list(topo.devices[:1])
