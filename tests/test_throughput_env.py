"""benchmarks/throughput.py: child environments, the table, the compile phase,
the microbatch per preset."""

import os
import sys

import pytest

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


def _fake_child(calls):
  def run_child(run, a, compile_only, timeout):
    calls.append((run, compile_only))
    if compile_only:
      return dict(compile_s=40.0, init_compile_s=2.0), "wall 45s"
    return dict(preset="1b", scheme=run.split("/")[1], routing="-",
                grad_accum=1, step_s=0.5, waited_step_s=0.5,
                tokens_per_s=64000.0, mfu=0.4, peak_bytes=2**30,
                xla_bytes=2**30, load_s=55.0), "wall 70s"
  return run_child


def test_compile_jobs_0_times_without_a_compile_phase(monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(throughput, "run_child", _fake_child(calls))
  monkeypatch.setattr(sys, "argv", ["throughput.py", "--runs",
                                    "1b/prenorm,1b/mhar", "--compile_jobs", "0"])
  throughput.main()
  assert calls == [("1b/prenorm", False), ("1b/mhar", False)]
  assert "| 1b | mhar | - | 1 | 55 | 500.0 |" in capsys.readouterr().out
  calls.clear()
  monkeypatch.setattr(sys, "argv", ["throughput.py", "--runs", "1b/prenorm",
                                    "--compile_jobs", "1"])
  throughput.main()
  assert calls == [("1b/prenorm", True), ("1b/prenorm", False)]
  assert "| 1b | prenorm | - | 1 | 40 | 500.0 |" in capsys.readouterr().out


def test_compile_only_needs_a_compiling_process(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["throughput.py", "--compile_only",
                                    "--compile_jobs", "0"])
  with pytest.raises(SystemExit):
    throughput.main()
  assert "--compile_jobs 0" in capsys.readouterr().err


def test_micro_tokens_per_preset(monkeypatch):
  assert throughput.micro_tokens("16384") == {"": 16384}
  table = throughput.micro_tokens("32768,1b=16384")
  assert [throughput.micro_tokens_of(table, p) for p in ("1b", "100m")] == [
      16384, 32768]
  cmds = []

  def fake_run(cmd, **kw):
    cmds.append(cmd)
    return throughput.subprocess.CompletedProcess(cmd, 0, 'RESULT {"ok": 1}')
  monkeypatch.setattr(throughput.subprocess, "run", fake_run)
  a = throughput.argparse.Namespace(
      steps=10, warmup=3, micro_tokens=table, routing_impl="auto",
      cache_dir="/tmp/c", profile=0, profile_runs="", xla_remat=False)
  for run in ("1b/mhar", "350m/mhar"):
    assert throughput.run_child(run, a, False, 10)[0] == {"ok": 1}
  assert [c[c.index("--micro_tokens") + 1] for c in cmds] == ["16384", "32768"]


@pytest.mark.parametrize("spec", ["1b=16384", "32768,1b", "32768,1b=0",
                                  "32768,1b=16k", "32768,1b=1,1b=2", ""])
def test_micro_tokens_rejects_a_bad_value_at_start_up(monkeypatch, capsys,
                                                       spec):
  monkeypatch.setattr(sys, "argv", ["throughput.py", "--micro_tokens", spec])
  with pytest.raises(SystemExit):
    throughput.main()
  err = capsys.readouterr().err
  assert "--micro_tokens" in err and "32768,1b=16384" in err
