"""benchmarks/kernel_time.py: kernel categories and the per-step breakdown."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                "benchmarks"))
import kernel_time  # noqa: E402


@pytest.mark.parametrize("name,cat", [
    ("_fwd_kernel", "routing (Triton)"),
    ("source_grad_kernel", "routing (Triton)"),
    ("sites_kernel", "routing (Triton)"),
    ("query_gain_grad_kernel", "routing (Triton)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attention (cuDNN)"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNN", "matmul"),
    ("gemm_fusion_dot_12", "matmul"),
    ("input_reduce_fusion_3", "reduction fusion"),
    ("copy_fusion_1", "copy / transpose"),
    ("loop_multiply_fusion_7", "elementwise fusion"),
    ("some_unknown_kernel", "other"),
])
def test_categorize(name, cat):
  assert kernel_time.categorize(name) == cat


def test_breakdown_divides_by_steps_and_ranks():
  # (name, ns, start ns): the add overlaps the first GEMM by 0.5 ms
  events = [("gemm_a", 4e6, 0.0), ("gemm_a", 4e6, 10e6),
            ("loop_add_fusion", 1e6, 3.5e6), ("_bwd_kernel", 3e6, 5e6)]
  b = kernel_time.breakdown(events, steps=2, top=2)
  assert b["total_ms"] == pytest.approx(6.0)
  assert b["busy_ms"] == pytest.approx(5.75)
  assert b["categories"] == pytest.approx(
      {"matmul": 4.0, "routing (Triton)": 1.5, "elementwise fusion": 0.5})
  assert b["top"][0] == ("gemm_a", pytest.approx(4.0), 1.0)
  assert len(b["top"]) == 2
  assert b["kernels"]["loop_add_fusion"] == pytest.approx([0.5, 0.5])
  assert len(b["kernels"]) == 3
  text = kernel_time.format_breakdown("x", b, step_ms=8.0)
  assert "72% busy" in text and "| matmul | 4.0 |" in text
  assert "overlap 0.2" in text
  # idle: 4.5-5 ms (after the add, before the bwd), 8-10 ms (after the bwd)
  assert b["span_ms"] == pytest.approx(7.0)
  assert b["idle_after"] == [("_bwd_kernel", pytest.approx(1.0), 0.5),
                             ("loop_add_fusion", pytest.approx(0.25), 0.5)]
  assert b["idle_before"][0] == ("gemm_a", pytest.approx(1.0), 0.5)
  assert "idle between kernels 1.2 ms a step (span 7.0 ms)" in text


def test_kernel_family_strips_numeric_suffixes():
  assert kernel_time.kernel_family("loop_add_fusion_584") == "loop_add_fusion"
  assert kernel_time.kernel_family("input_reduce_fusion_3_1") == (
      "input_reduce_fusion")
  assert kernel_time.kernel_family("sm90_gemm_128x128") == "sm90_gemm_128x128"


def test_kernel_events_without_trace_or_device(tmp_path):
  with pytest.raises(FileNotFoundError):
    kernel_time.kernel_events(str(tmp_path))
  import jax
  import jax.numpy as jnp
  f = jax.jit(lambda x: (x * 2).sum())
  f(jnp.ones(8)).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    f(jnp.ones(8)).block_until_ready()
  with pytest.raises(ValueError, match="no plane"):
    kernel_time.kernel_events(str(tmp_path), device="/device:GPU:0")
