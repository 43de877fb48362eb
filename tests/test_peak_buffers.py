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
