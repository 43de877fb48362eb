"""benchmarks/byte_bounds.py: the arrays the library's routing moves."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                "benchmarks"))
import byte_bounds  # noqa: E402
from stack_routing import routing_bytes, sources_read  # noqa: E402

from mhar_jax.layers.router import block_boundaries  # noqa: E402


def test_full_forward_matches_the_1b_launches():
  # The 1b step's kernels (RESULTS.md session 22): the groups' first phases
  # read 1 + 16 + 32 + 48 + 64 sources and write 73 results; the in-group
  # sites read 510 sources and 68 first-phase rows and write 68 outputs.
  parts = byte_bounds.default_arrays(72, range(72), share=0.0, d=1280)
  assert parts["forward routing"] == 161 + 73 + 510 + 68 + 68
  assert parts["recomputed outputs"] == 0
  assert parts["buffer copies"] == 2 * 72 and parts["inverse RMS"] == 73
  # the sources kernel's four launches read 16, 32, 48 and 64 sites'
  # cotangents, besides 3 x 16 + 9 sources read and their sums written
  dlr = 8 * 4 / (2 * 1280)
  pairs = 16 * (16 + 32 + 48) + 9 * 64
  assert parts["sources' group shares"] == pytest.approx(
      160 + 2 * 57 + pairs * dlr)


@pytest.mark.parametrize("n,blocks", [(24, 8), (48, 8), (72, 8), (12, 3)])
def test_blocks_route_site_by_site(n, blocks):
  b = block_boundaries(n, blocks)
  parts = byte_bounds.default_arrays(n, b, share=1.0, d=512)
  fwd, total = routing_bytes(n, b, 1)    # one array: e = 1
  pairs = fwd - (n + 1)                  # (site, source) pairs
  assert total == fwd + 2 * pairs + n + 1
  assert parts["forward routing"] == fwd
  # every site but the last (no norm: s_0 and every block sum, one output)
  # recomputes its output as the forward routed it
  assert parts["recomputed outputs"] == fwd - (blocks + 1 + 1)
  # each source: read, its gradient written, each reader's cotangent read
  dlr = 8 * 4 / (2 * 512)
  assert parts["per-source gradients"] == pytest.approx(
      2 * parts["inverse RMS"] + pairs * (1 + dlr))
  # s_0, the block sums, one partial sum for each sublayer after its
  # block's first
  assert parts["inverse RMS"] == 1 + blocks + (n - blocks)


@pytest.mark.parametrize("n,blocks", [(72, None), (48, 8)])
def test_8_bit_sources_halve_only_the_source_reads(n, blocks):
  b = list(range(n)) if blocks is None else block_boundaries(n, blocks)
  bf16 = byte_bounds.default_arrays(n, b, share=0.75, d=1024)
  int8 = byte_bounds.default_arrays(n, b, share=0.75, d=1024, source_bytes=1)
  if blocks is None:
    # 1b-sized full method: the first phases read 1 + 16 + ... + 64 sources
    # (n = 72: groups of 16 from site 0), the in-group sites 510; results
    # and outputs (73 + 68 + 68) stay bf16
    assert int8["forward routing"] == (161 + 510) / 2 + 73 + 68 + 68
    assert int8["buffer copies"] == 1.5 * n   # bf16 read, 8-bit write
  else:
    # Block: each source written once more in 8 bits; the forward's pairs
    # read at half width, each site's output written in bf16
    pairs = sum(sources_read(n, b))
    sources = bf16["inverse RMS"]
    assert int8["forward routing"] == pairs / 2 + n + 1
    assert int8["buffer copies"] == sources / 2
  for part in ("inverse RMS", "block sums", "baseline residual"):
    assert int8[part] == bf16[part]
  # cotangents, gradients, dlogit r and the sums' writes stay as they were:
  # the per-source gradients lose exactly half their source reads
  assert bf16["per-source gradients"] - int8["per-source gradients"] == (
      pytest.approx((n + 1 if blocks is None else sources) / 2))
