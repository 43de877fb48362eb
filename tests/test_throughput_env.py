"""benchmarks/throughput.py: a run's child-process environment."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                "benchmarks"))
import throughput  # noqa: E402


def test_child_env_adds_the_runs_xla_flags(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
  env = throughput.child_env(False, "1b/mhar+kernels.route.ffi_launch=True"
                             "+xla.xla_gpu_enable_command_buffer=FUSION;CUBLAS")
  assert env["XLA_FLAGS"].split() == [
      "--xla_dump_to=/tmp/d", throughput.NO_REMAT,
      "--xla_gpu_enable_command_buffer=FUSION,CUBLAS"]
  env = throughput.child_env(True, "1b/prenorm")
  assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
