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


def test_table_gives_back_to_back_and_waited_steps(capsys):
  row = dict(preset="1b", routing="-", grad_accum=1, compile_s=50.0,
             peak_bytes=2**30, xla_bytes=2**30, mfu=0.4)
  throughput.print_table([
      dict(row, scheme="prenorm", step_s=0.5, waited_step_s=0.51,
           tokens_per_s=64000.0),
      dict(row, scheme="mhar", step_s=0.55, waited_step_s=0.57,
           tokens_per_s=58000.0)])
  out = capsys.readouterr().out
  assert "| step ms | waited ms | tokens/s |" in out
  assert "| 550.0 | 570.0 | 58,000 |" in out
  assert "| 0.906 |" in out      # the ratio of the back-to-back tokens/s
