"""benchmarks/hlo_copies.py: finding the data-movement kernels in optimized HLO."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                "benchmarks"))
import hlo_copies  # noqa: E402

HLO = """HloModule jit_step, entry_computation_layout={()}

%wrapped_slice_computation (param_0: bf16[4,8,16]) -> bf16[1,8,16] {
  %param_0 = bf16[4,8,16]{2,1,0} parameter(0)
  ROOT %slice.1 = bf16[1,8,16]{2,1,0} slice(%param_0), slice={[2:3], [0:8], [0:16]}
}

%fused_add (p0: f32[8,16], p1: f32[8,16]) -> f32[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  ROOT %add.2 = f32[8,16]{1,0} add(%p0, %p1)
}

%body (arg: (bf16[4,8,16], f32[8,16])) -> (bf16[4,8,16], f32[8,16]) {
  %arg = (bf16[4,8,16]{2,1,0}, f32[8,16]{1,0}) parameter(0)
  %buf = bf16[4,8,16]{2,1,0} get-tuple-element(%arg), index=0
  %acc = f32[8,16]{1,0} get-tuple-element(%arg), index=1
  %wrapped_slice.3 = bf16[1,8,16]{2,1,0} fusion(%buf), kind=kLoop, calls=%wrapped_slice_computation, metadata={op_name="jit(step)/transpose(jvp())/slice"}
  %loop_add_fusion = f32[8,16]{1,0} fusion(%acc, %acc), kind=kLoop, calls=%fused_add
  %copy.4 = f32[8,16]{0,1} copy(%loop_add_fusion)
  ROOT %t = (bf16[4,8,16]{2,1,0}, f32[8,16]{1,0}) tuple(%buf, %copy.4)
}

ENTRY %main (p: bf16[4,8,16]) -> bf16[4,8,16] {
  %p = bf16[4,8,16]{2,1,0} parameter(0)
  ROOT %copy.5 = bf16[4,8,16]{2,1,0} copy(%p)
}
"""


def test_shape_bytes():
  assert hlo_copies.shape_bytes("bf16[16,32,1024,1280]{3,2,1,0}") == (
      2 * 16 * 32 * 1024 * 1280)
  assert hlo_copies.shape_bytes("(bf16[2,3]{1,0}, f32[4]{0})") == 12 + 16
  assert hlo_copies.shape_bytes("f32[]") == 4


def test_copies_finds_slices_and_copies_not_arithmetic():
  found = hlo_copies.copies(HLO)
  got = {(c["computation"], c["name"], c["bytes"]) for c in found}
  assert got == {("body", "wrapped_slice.3", 2 * 2 * 8 * 16),
                 ("body", "copy.4", 2 * 4 * 8 * 16),
                 ("main", "copy.5", 2 * 2 * 4 * 8 * 16)}
  sliced = [c for c in found if c["name"] == "wrapped_slice.3"][0]
  assert sliced["op"] == "jit(step)/transpose(jvp())/slice"
  text = hlo_copies.summary(found, 4, min_bytes=0)
  assert "body: 2 copies" in text and "main: 1 copies" in text
