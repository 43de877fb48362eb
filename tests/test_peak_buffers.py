"""benchmarks/peak_buffers.py: reading XLA's live-range dump at the peak."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                "benchmarks"))
import peak_buffers  # noqa: E402

DUMP = """HloLiveRange (max 12):
  InstructionSequence:
    0:p0
  BufferLiveRange:
    p0{}:0-12
  Live ranges at 7 (peak):
    fusion.3{}: 4194304 bytes (cumulative: 4194304 bytes)
    custom-call.1{}: 16777216 bytes (cumulative: 20971520 bytes)
    copy.2{}: 1024 bytes (cumulative: 20972544 bytes)
  Stack trace breakdown for peak usage: 20 972 544 bytes
    main.9 (100.0%, total: 20 972 544 bytes, current: 0 bytes, remaining: 20 972 544 bytes)
      ├── jit(step)/jvp(jvp(vmap()))/div (80.0%, total: 16 777 216 bytes, current: 16 777 216 bytes, remaining: 4 195 328 bytes)
      ├── jit(step)/transpose(jvp(btd,dhk->bthk))/dot_general (20.0%, total: 4 194 304 bytes, current: 4 194 304 bytes, remaining: 1 024 bytes)
      │   └── inner (20.0%, total: 4 194 304 bytes, current: 4 194 304 bytes, remaining: 1 024 bytes)
      └── state (0.0%, total: 1 024 bytes, current: 1 024 bytes, remaining: 0 bytes)
"""


def test_peak_report_reads_the_peak():
  rep = peak_buffers.peak_report(DUMP)
  assert rep["position"] == 7 and rep["peak"] == 20972544
  assert rep["live"][0] == ("custom-call.1{}", 16777216)
  assert [n for _, n in rep["live"]] == [16777216, 4194304, 1024]
  assert rep["by_op"] == [
      ("jit(step)/jvp(jvp(vmap()))/div", 16777216),
      ("jit(step)/transpose(jvp(btd,dhk->bthk))/dot_general", 4194304),
      ("state", 1024)]


def test_op_key_drops_transformation_wrappers():
  assert peak_buffers.op_key("jit(step)/jvp(jvp(vmap()))/div") == "div"
  assert peak_buffers.op_key("jit(step)/jvp()/div") == "div"
  assert (peak_buffers.op_key(
      "jit(step)/transpose(jvp(btd,dhk->bthk))/dot_general")
      == "bwd btd,dhk->bthk/dot_general")


def test_peak_report_without_a_peak_section():
  rep = peak_buffers.peak_report("HloLiveRange (max 0):\n")
  assert rep == dict(position=None, peak=None, live=[], by_op=[])


def test_rematerialized_counts_the_remat_pass_copies():
  hlo = """ENTRY %main {
  %fusion.3 = f32[4]{0} fusion(%p0), kind=kLoop
  %fusion.3.remat = f32[4]{0} fusion(%p0), kind=kLoop
  %convert.1.remat2 = bf16[4]{0} convert(%fusion.3.remat)
  ROOT %tuple.5 = (f32[4]) tuple(%fusion.3)
}"""
  assert peak_buffers.rematerialized(hlo) == 2


def test_heap_report_finds_the_hole_at_the_live_peak():
  """A 4-byte buffer holds offset 0 early on and a 6-byte one sits above
  it: 10 bytes allocated. With the two overlapping in time, 10 are live at
  once; with the first dead before the second starts, the most live is 8 and
  the layout then has a hole where the first was."""
  assignment = """allocation 0: size 8, parameter 0:
 value: <1 p0 @0> (size=8,offset=0): f32[2]
allocation 1: size 10, preallocated-temp:
 value: <2 early{} @0> (size=4,offset=0): f32[1]
 value: <3 late @0> (size=6,offset=4): f32[1]
 value: <4 later @0> (size=2,offset=0): f32[1]
"""
  live_range = """  BufferLiveRange:
    p0{}:0-9
    early{}:0-3
    late{}:2-8
    later{}:6-8
"""
  rep = peak_buffers.heap_report(assignment, live_range, min_hole=2)
  assert rep["extent"] == 10
  assert rep["live"] == 10 and rep["at"] == 2     # early and late overlap at 2
  rep = peak_buffers.heap_report(assignment, live_range.replace("0-3", "0-2"),
                                 min_hole=2)
  # early ends as late starts: at most 8 live (late + later, from 6), and
  # then the 2 bytes between later and late are a hole that early held
  assert rep["live"] == 8 and rep["at"] == 6
  assert rep["holes"] == [(2, 2, [("early", 4, 0, 2)])]
  assert rep["at_peak"] == [("late", 6, 2, 8), ("later", 2, 6, 8)]
  assert peak_buffers.heap_report("", "") == dict(extent=0, live=0, at=None,
                                                  at_peak=[], holes=[])


def test_op_names_maps_instructions_to_jax_operations():
  hlo = """ENTRY %main {
  %fusion.3 = f32[4]{0} fusion(%p0), kind=kLoop, metadata={op_name="jit(step)/jvp()/mul" stack_frame_id=2}
  ROOT %t = (f32[4]) tuple(%fusion.3)
}"""
  assert peak_buffers.op_names(hlo) == {"fusion.3": "jit(step)/jvp()/mul"}
