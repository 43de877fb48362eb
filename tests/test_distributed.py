"""Tests for mhar_jax.distributed: env detection (pure), 2-process CPU run
(collectives, pre-emption agreement, sharded multi-process checkpoint), and a
dead peer making the survivor exit instead of hanging."""

import os
import signal
import subprocess
import sys
import time

import portpicker
import pytest

from mhar_jax import distributed
from mhar_jax.distributed import ClusterSpec, detect_cluster, first_slurm_host

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("nodelist,host", [
    ("node[01-03],gpu7", "node01"),
    ("gpu7,node[01-03]", "gpu7"),
    ("node001", "node001"),
    ("a[007,010-012],b1", "a007"),
    ("rack1-n[3-4]", "rack1-n3"),
    ("x[5]", "x5"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_detect_single_process():
    assert detect_cluster({}) is None
    assert detect_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert detect_cluster({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}) is None
    assert detect_cluster({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1",
                           "JAX_PROCESS_ID": "0"}) is None


def test_detect_slurm():
    env = {"SLURM_JOB_ID": "12345", "SLURM_NTASKS": "6", "SLURM_PROCID": "4", "SLURM_LOCALID": "1",
           "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NODELIST": "node[01-03],gpu7"}
    port = 12345 % 4096 + 61440  # jax's formula
    assert detect_cluster(env) == ClusterSpec(f"node01:{port}", 6, 4, (1,), "slurm")
    # Job node list as fallback; one task per node -> all local devices; port override.
    env = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[7-8]", "MHAR_COORDINATOR_PORT": "4000"}
    assert detect_cluster(env) == ClusterSpec("gpu7:4000", 2, 1, None, "slurm")
    # Explicit coordinator address wins over the node list.
    env["MHAR_COORDINATOR_ADDRESS"] = "10.0.0.5:1234"
    assert detect_cluster(env).coordinator_address == "10.0.0.5:1234"
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        detect_cluster({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"})


def test_detect_ompi():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MHAR_COORDINATOR_ADDRESS": "head:5555"}
    assert detect_cluster(env) == ClusterSpec("head:5555", 4, 3, (1,), "ompi")
    del env["MHAR_COORDINATOR_ADDRESS"]
    env["OMPI_MCA_orte_hnp_uri"] = "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"
    spec = detect_cluster(env)
    assert spec.coordinator_address == f"10.96.0.1:{1531576320 // 4096 % 4096 + 61440}"
    del env["OMPI_MCA_orte_hnp_uri"]
    with pytest.raises(ValueError, match="MHAR_COORDINATOR_ADDRESS"):
        detect_cluster(env)


def test_detect_generic_env():
    env = {"JAX_COORDINATOR_ADDRESS": "pod-0.svc:1234", "JAX_NUM_PROCESSES": "8", "JOB_COMPLETION_INDEX": "5",
           "JAX_LOCAL_DEVICE_IDS": "0,1"}
    assert detect_cluster(env) == ClusterSpec("pod-0.svc:1234", 8, 5, (0, 1), "env")
    env["MHAR_PROCESS_ID"] = "6"
    assert detect_cluster(env).process_id == 6
    # Generic variables take precedence over an enclosing SLURM allocation.
    env.update(SLURM_JOB_ID="1", SLURM_NTASKS="2", SLURM_PROCID="0", SLURM_JOB_NODELIST="n1")
    assert detect_cluster(env).source == "env"
    with pytest.raises(ValueError, match="process id"):
        detect_cluster({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})


def test_initialize_single_process_is_noop():
    info = distributed.initialize(env={})
    assert info.process_count == 1 and info.process_index == 0 and info.source in ("single", "external")
    assert len(info.global_devices) >= 1
    assert "process 0/1" in distributed.describe()
    saved, distributed._INFO = distributed._INFO, None
    try:
        with pytest.raises(ValueError, match="or none"):
            distributed.initialize(coordinator_address="localhost:1")
    finally:
        distributed._INFO = saved


# ----------------------------------------------------------------------------
# Multi-process (subprocess) tests
# ----------------------------------------------------------------------------

WORKER = r'''
import os, sys, time
pid, port, ckdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def say(msg):  # one write per line: gloo's C++ logging shares stdout
    os.write(1, (msg + "\n").encode())
# Generic env-var launch (as a Kubernetes Indexed Job would set it).
os.environ.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
from mhar_jax import distributed
info = distributed.initialize(heartbeat_timeout=10, shutdown_timeout=20, initialization_timeout=30)
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from mhar_jax.checkpoint import Checkpointer, PreemptionHandler, abstract_like
assert info.source == "env" and info.process_count == 2 and info.process_index == pid
assert len(info.local_devices) == 2 and len(info.global_devices) == 4
assert jax.config.jax_cpu_collectives_implementation == "gloo"
say(f"{pid} DESCRIBE {distributed.describe()}")

# psum over all 4 devices of both processes + process_allgather.
mesh = jax.make_mesh((4,), ("d",))
x = jax.make_array_from_callback((4,), NamedSharding(mesh, P("d")), lambda i: np.arange(4.0)[i] + 1)
total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x))
gathered = multihost_utils.process_allgather(np.int32(100 + pid)).tolist()
say(f"{pid} PSUM {total} GATHER {gathered}")

# Pre-emption: SIGTERM reaches only process 1; both must stop at the same step.
stopper = PreemptionHandler(sync_every=5).install()
say(f"{pid} READY")
step = 0
while step < 3000:
    step += 1
    time.sleep(0.01)
    if stopper.should_stop(step):
        break
say(f"{pid} STOP {step} {stopper.stop_requested}")

# Multi-process checkpoint of an array sharded over both processes, with a
# per-process data-iterator state.
w = jax.make_array_from_callback((8, 2), NamedSharding(mesh, P("d")),
                                 lambda i: np.arange(16.0).reshape(8, 2)[i] * step)
# Every jax.Array must be a global array: the step counter is replicated.
st = {"w": w, "step": jax.device_put(jnp.array(step), NamedSharding(mesh, P())), "lr": np.float32(0.5)}
with Checkpointer(ckdir, max_to_keep=2) as ck:
    ck.save(step, st, {"shard": pid, "pos": step * 10 + pid}, {"fingerprint": {"n": 1}})
    ck.wait()
    state, data, meta = ck.restore(abstract_state=abstract_like(st))
assert int(multihost_utils.process_allgather(state["step"], tiled=True)) == step
assert float(state["lr"]) == 0.5
assert state["w"].sharding == w.sharding
np.testing.assert_array_equal(multihost_utils.process_allgather(state["w"], tiled=True),
                              np.arange(16.0).reshape(8, 2) * step)
assert data == {"shard": pid, "pos": step * 10 + pid}, data
say(f"{pid} CKPT {meta['step']} {meta['process_count']}")
'''


def _env():
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS_ID", "MHAR_")):
            del env[k]
    env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return env


def _start(code_path, *args):
    return subprocess.Popen([sys.executable, str(code_path), *map(str, args)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _readline_until(p, token, deadline):
    """Reads ``p.stdout`` lines until one contains ``token`` (or fails at deadline)."""
    lines = []
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if token in line:
            return lines
    raise AssertionError(f"{token!r} not seen; got {lines}; stderr: {p.stderr.read()[-3000:]}")


def _finish(procs, timeout):
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


@pytest.mark.slow
def test_two_processes_collectives_preemption_checkpoint(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = portpicker.pick_unused_port()
    ck = tmp_path / "ck"
    procs = [_start(script, i, port, ck) for i in range(2)]
    deadline = time.time() + 60
    early = [_readline_until(p, "READY", deadline) for p in procs]
    time.sleep(0.3)
    procs[1].send_signal(signal.SIGTERM)
    outs = _finish(procs, timeout=60)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    text = ["".join(e) + o for e, (o, _) in zip(early, outs)]
    for i, t in enumerate(text):
        assert f"{i} PSUM 10.0 GATHER [100, 101]" in t, t
    stops = [t.split("STOP ")[1].split() for t in text]
    assert stops[0][0] == stops[1][0], stops  # same step on both processes
    assert int(stops[0][0]) % 5 == 0
    assert stops[0][1] == "False" and stops[1][1] == "True"  # only process 1 got the signal
    for t in text:
        assert f"CKPT {stops[0][0]} 2" in t
    assert sorted(os.listdir(ck / stops[0][0] / "data")) == ["commit_success.txt", "process_0.json",
                                                             "process_1.json"]


DEAD_PEER = r'''
import os, sys, time
pid, port, victim = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
from mhar_jax import distributed
distributed.initialize(f"localhost:{port}", 2, pid, heartbeat_timeout=5, shutdown_timeout=5,
                       initialization_timeout=30)
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("up")
print(f"{pid} UP", flush=True)
if pid == victim:
    os._exit(7)  # dies without jax.distributed.shutdown()
t0 = time.time()
while time.time() - t0 < 120:  # the survivor would otherwise idle here
    time.sleep(0.2)
print(f"{pid} STILL ALIVE", flush=True)
'''


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["worker_dies", "coordinator_dies"])
def test_dead_peer_makes_survivor_exit(tmp_path, victim):
    script = tmp_path / "dead.py"
    script.write_text(DEAD_PEER)
    port = portpicker.pick_unused_port()
    procs = [_start(script, i, port, victim) for i in range(2)]
    deadline = time.time() + 60
    for p in procs:
        _readline_until(p, "UP", deadline)
    t0 = time.time()
    outs = _finish(procs, timeout=45)
    elapsed = time.time() - t0
    survivor = 1 - victim
    assert procs[victim].returncode == 7
    out, err = outs[survivor]
    assert "STILL ALIVE" not in out
    assert procs[survivor].returncode != 0, err[-3000:]
    assert elapsed < 30, elapsed  # heartbeat_timeout=5 s, not the 100 s default or a hang


@pytest.mark.slow
def test_missing_peer_fails_within_initialization_timeout(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(
        "import sys\nfrom mhar_jax import distributed\n"
        f"distributed.initialize('localhost:{portpicker.pick_unused_port()}', 2, 1, "
        "initialization_timeout=1)\nprint('CONNECTED')\n")
    t0 = time.time()
    (out, err), = _finish([_start(script)], timeout=45)
    assert "CONNECTED" not in out
    assert time.time() - t0 < 30
