"""Tests for mhar_jax.checkpoint: round trip, keep-N, async, robust restore,
architecture check, unwritable dir, failed saves, crash mid-save, SIGTERM."""

import errno
import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mhar_jax.checkpoint import (
    CheckpointDirectoryError, Checkpointer, CheckpointSaveError, NoValidCheckpointError,
    PreemptionHandler, abstract_like, any_process, check_compatible, check_writable,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP = {"model": {"num_layers": 12, "d_model": 64, "attn": "mhar"}}


def _state(seed=0, n=256):
    k = jax.random.key(seed)
    return {
        "params": {"w": jax.random.normal(k, (n, 8)), "b": jnp.arange(8.0) + seed},
        "opt": {"mu": jnp.full((n, 8), float(seed)), "count": jnp.array(seed, jnp.int32)},
        "step": jnp.array(seed, jnp.int32),
        "rng": jax.random.fold_in(k, 1),  # typed key
        "rng_data": jax.random.key_data(k),  # raw uint32 key data
    }


def _np(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _assert_tree_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(_np(x), _np(y))


def _save(ck, step, **kw):
    return ck.save(step, _state(step), {"pos": step, "epoch": 0},
                   {"fingerprint": FP, "tokens_seen": 1000 * step, **kw})


def _env(**extra):
    env = dict(os.environ)
    env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env.update(extra)
    return env


def _run_py(code, timeout=60, **env):
    """Runs ``code`` in a fresh interpreter (hard timeout); returns CompletedProcess."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------


def test_round_trip_typed_keys_bytes_and_meta(tmp_path):
    ck = Checkpointer(tmp_path / "ck", max_to_keep=3)
    st = _state(7)
    assert ck.latest_step() is None
    assert ck.save(7, st, b"\x00\x01grain-state\xff", {"fingerprint": FP, "tokens_seen": 123,
                                                        "config": {"lr": np.float32(3e-4)}})
    ck.wait()
    assert ck.latest_step() == 7
    state, data, meta = ck.restore(abstract_state=abstract_like(st))
    _assert_tree_equal(state, st)
    assert data == b"\x00\x01grain-state\xff"
    assert meta["step"] == 7 and meta["tokens_seen"] == 123 and meta["fingerprint"] == FP
    assert meta["process_count"] == 1 and meta["config"]["lr"] == pytest.approx(3e-4)
    # Restoring without a target works too (single process), and saving the
    # same step again is a no-op.
    state2, _, _ = ck.restore(7)
    np.testing.assert_array_equal(np.asarray(state2["params"]["w"]), np.asarray(st["params"]["w"]))
    assert ck.save(7, st) is False
    ck.close()


def test_nnx_state_round_trip(tmp_path):
    from flax import nnx

    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state)
        abstract = nnx.state(nnx.eval_shape(lambda: nnx.Linear(4, 3, rngs=nnx.Rngs(1))))
        restored, _, _ = ck.restore(abstract_state=abstract)
    nnx.update(model2 := nnx.Linear(4, 3, rngs=nnx.Rngs(5)), restored)
    np.testing.assert_array_equal(np.asarray(model2.kernel[...]), np.asarray(model.kernel[...]))


def test_keep_n_and_async(tmp_path):
    ck = Checkpointer(tmp_path, max_to_keep=2)
    big = {"w": jnp.ones((1024, 1024))}  # 4 MB
    t0 = time.perf_counter()
    ck.save(1, big)
    blocking = time.perf_counter() - t0
    # Asynchronous: the commit (rename of the tmp dir) happens in the background.
    assert ck._pending == 1
    ck.wait()
    assert os.path.isdir(tmp_path / "1") and not glob.glob(str(tmp_path / "1.orbax-checkpoint-tmp*"))
    for s in (2, 3, 4):
        _save(ck, s)
    ck.close()
    assert Checkpointer(tmp_path).all_steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]
    assert blocking < 5.0


def test_sync_mode(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    _save(ck, 1)
    assert ck._pending is None and os.path.isdir(tmp_path / "1")
    ck.close()


CORRUPTIONS = {
    "truncate_state_chunks": lambda d: [
        open(p, "r+b").truncate(os.path.getsize(p) // 2)
        for p in glob.glob(f"{d}/state/**/d/*", recursive=True)],
    "delete_data_item": lambda d: shutil.rmtree(f"{d}/data"),
    "delete_state_metadata": lambda d: os.remove(f"{d}/state/_METADATA"),
    "delete_step_metadata": lambda d: os.remove(f"{d}/_CHECKPOINT_METADATA"),
    "truncate_meta_json": lambda d: open(f"{d}/meta/meta.json", "r+b").truncate(5),
}


# A failed tensorstore read can leave an orbax/asyncio callback that fires after
# its event loop closed ("Event loop is closed"): harmless, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog, corruption):
    ck = Checkpointer(tmp_path, max_to_keep=5)
    for s in (1, 2, 3):
        _save(ck, s)
    ck.wait()
    CORRUPTIONS[corruption](str(tmp_path / "3"))
    with caplog.at_level(logging.WARNING, logger="mhar_jax.checkpoint"):
        state, data, meta = ck.restore(abstract_state=abstract_like(_state(0)))
    assert meta["step"] == 2 and data == {"pos": 2, "epoch": 0}
    _assert_tree_equal(state, _state(2))
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 3" in m and "skipping" in m for m in msgs), msgs
    # The bad step was moved aside: not listed, and step 3 can be saved again.
    assert ck.latest_step() == 2
    assert glob.glob(str(tmp_path / "3.corrupt-*"))
    assert _save(ck, 3)
    ck.close()


def test_no_valid_checkpoint(tmp_path, caplog):
    ck = Checkpointer(tmp_path)
    with pytest.raises(FileNotFoundError):
        ck.restore()
    _save(ck, 1)
    _save(ck, 2)
    ck.wait()
    for s in (1, 2):
        shutil.rmtree(tmp_path / str(s) / "state")
    with caplog.at_level(logging.WARNING, logger="mhar_jax.checkpoint"):
        with pytest.raises(NoValidCheckpointError, match=r"step 2: missing item directory 'state'.*step 1"):
            ck.restore()
    assert any("no usable checkpoint" in r.getMessage() for r in caplog.records)
    assert ck.all_steps() == [1, 2]  # nothing renamed when nothing restored
    # An explicit step is not replaced by another one.
    with pytest.raises(NoValidCheckpointError, match="step 2"):
        ck.restore(2)
    ck.close()


def test_process_count_mismatch(tmp_path):
    with Checkpointer(tmp_path) as ck:
        _save(ck, 1)
        ck.wait()
        path = tmp_path / "1" / "meta" / "meta.json"
        path.write_text(path.read_text().replace('"process_count": 1', '"process_count": 2'))
        with pytest.raises(ValueError, match="written by 2 processes.*restore_data=False"):
            ck.restore()
        state, data, meta = ck.restore(restore_data=False)
        assert data is None and meta["step"] == 1
        np.testing.assert_array_equal(np.asarray(state["opt"]["mu"]), np.full((256, 8), 1.0))


def test_check_compatible():
    check_compatible({"fingerprint": FP}, FP)
    other = {"model": {"num_layers": 24, "d_model": 64, "attn": "mhar", "heads": 4}}
    with pytest.raises(ValueError) as e:
        check_compatible({"fingerprint": FP}, other)
    msg = str(e.value)
    assert "model.num_layers: checkpoint 12, config 24" in msg
    assert "model.heads: checkpoint <missing>, config 4" in msg
    assert "d_model" not in msg
    # a key only the checkpoint holds (an older fingerprint's) is not compared
    check_compatible({"fingerprint": {"model": {**FP["model"], "remat": True}}}, FP)


def test_restore_rejects_other_architecture(tmp_path):
    with Checkpointer(tmp_path) as ck:
        _save(ck, 1)
        with pytest.raises(ValueError, match="model.num_layers: checkpoint 12, config 24"):
            ck.restore(expected_fingerprint={"model": {**FP["model"], "num_layers": 24}})
        assert ck.all_steps() == [1]  # a mismatch is not treated as corruption


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = blocker / "ckpt"
    with pytest.raises(CheckpointDirectoryError, match=str(bad)):
        check_writable(bad)
    with pytest.raises(CheckpointDirectoryError, match="not writable"):
        Checkpointer(bad)
    assert str(check_writable(tmp_path / "new" / "dir")) == str(tmp_path / "new" / "dir")
    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(CheckpointDirectoryError, match="ro"):
                check_writable(ro)
        finally:
            ro.chmod(0o700)


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


async def _async_enospc(*args, **kwargs):
    _enospc()


def test_background_save_failure_keeps_previous(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, max_to_keep=1)
    _save(ck, 1)
    ck.wait()
    # Disk full while the background thread writes the JSON items.
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", _async_enospc)
    _save(ck, 2)  # returns: the failure happens in the background
    with pytest.raises(CheckpointSaveError, match=r"step 2.*No space left on device.*latest: 1"):
        ck.wait()
    monkeypatch.undo()
    assert ck.all_steps() == [1]  # max_to_keep=1 did not delete step 1
    _, data, meta = ck.restore()
    assert meta["step"] == 1 and data["pos"] == 1
    _save(ck, 3)  # the manager still works afterwards
    ck.close()
    ck = Checkpointer(tmp_path, max_to_keep=1)
    assert ck.all_steps() == [3]
    _save(ck, 4)  # (waits for Orbax's start-up clean-up of stale tmp dirs)
    ck.close()
    assert sorted(os.listdir(tmp_path)) == ["4"]  # the failed save's tmp dir is gone


def test_blocking_save_failure_keeps_previous(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, max_to_keep=1)
    _save(ck, 1)
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", _async_enospc)
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint step 2 .*No space left"):
        _save(ck, 2)
    monkeypatch.undo()
    assert ck.all_steps() == [1]
    assert ck.restore()[2]["step"] == 1
    ck.close()


def test_preemption_handler_single_process():
    h = PreemptionHandler(signals=(signal.SIGUSR1,)).install()
    try:
        assert not h.should_stop(0)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # let the interpreter run the handler
        assert h.stop_requested and h.received == signal.SIGUSR1
        assert h.should_stop(1) and h.should_stop(2)  # latched
    finally:
        h.uninstall()
    assert any_process(True) and not any_process(False)


# ----------------------------------------------------------------------------
# Subprocess tests
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_sharded_round_trip_and_reshard(tmp_path):
    code = f"""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from mhar_jax.checkpoint import Checkpointer, abstract_like
        assert jax.device_count() == 4
        mesh = jax.make_mesh((4,), ("d",))
        w = jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("d")))
        st = {{"w": w, "step": jnp.array(3)}}
        with Checkpointer({str(tmp_path)!r}) as ck:
            ck.save(3, st, {{"pos": 3}})
            # Restore onto a different layout: 2x2 mesh, sharded on both axes.
            mesh2 = jax.make_mesh((2, 2), ("a", "b"))
            target = abstract_like(st)
            target["w"] = jax.ShapeDtypeStruct((16, 4), jnp.float32,
                                               sharding=NamedSharding(mesh2, P("a", "b")))
            out, data, meta = ck.restore(abstract_state=target)
        assert out["w"].sharding == target["w"].sharding, out["w"].sharding
        assert len(out["w"].addressable_shards) == 4
        np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(64.0).reshape(16, 4))
        print("OK", data, meta["step"])
    """
    r = _run_py(code, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK {'pos': 3} 3" in r.stdout


CRASH_CHILD = """
import asyncio, sys, time
import jax.numpy as jnp
import orbax.checkpoint as ocp
from mhar_jax.checkpoint import Checkpointer
d = sys.argv[1]
ck = Checkpointer(d, max_to_keep=3)
ck.save(1, {"w": jnp.zeros((8, 8)), "step": jnp.array(1)}, {"pos": 1}, {"step_note": 1})
ck.wait()
# Make the background write of step 2 slow (as on a slow file system) so that
# the SIGKILL is sure to land mid-save, after the arrays started being written.
orig = ocp.JsonCheckpointHandler._save_fn
async def slow(self, x, directory):
    await asyncio.sleep(60)
    await orig(self, x, directory)
ocp.JsonCheckpointHandler._save_fn = slow
ck.save(2, {"w": jnp.ones((2048, 2048)), "step": jnp.array(2)}, {"pos": 2})
print("SAVING", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_crash_mid_save_restores_previous(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CRASH_CHILD)
    d = tmp_path / "ck"
    p = subprocess.Popen([sys.executable, str(script), str(d)], env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        line = p.stdout.readline()
        assert line.strip() == "SAVING", p.stderr.read()[-3000:] if p.poll() is not None else line
        # Wait until array data of step 2 is on disk, then kill -9.
        while not glob.glob(str(d / "2.orbax-checkpoint-tmp*/state*/**/d/*"), recursive=True):
            assert time.time() < deadline and p.poll() is None, "child never started writing step 2"
            time.sleep(0.05)
        p.kill()
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
        p.stdout.close()
        p.stderr.close()
    assert p.returncode == -signal.SIGKILL
    names = os.listdir(d)
    assert "1" in names and "2" not in names and any(n.startswith("2.orbax-checkpoint-tmp") for n in names)
    ck = Checkpointer(d)
    assert ck.all_steps() == [1] and ck.latest_step() == 1
    state, data, meta = ck.restore(abstract_state={"w": jax.ShapeDtypeStruct((8, 8), jnp.float32),
                                                   "step": jax.ShapeDtypeStruct((), jnp.int32)})
    assert meta["step"] == 1 and data == {"pos": 1}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.zeros((8, 8)))
    ck.save(2, {"w": jnp.ones((8, 8)), "step": jnp.array(2)})
    ck.close()
    assert sorted(os.listdir(d)) == ["1", "2"]  # the partial save's tmp dir was removed


SIGTERM_CHILD = """
import sys, time
import jax, jax.numpy as jnp
from mhar_jax.checkpoint import Checkpointer, PreemptionHandler
d = sys.argv[1]
stopper = PreemptionHandler().install()
ck = Checkpointer(d, max_to_keep=2)
state = {"w": jnp.zeros((64,)), "step": jnp.array(0)}
update = jax.jit(lambda s: {"w": s["w"] + 1.0, "step": s["step"] + 1})
step = 0
print("READY", flush=True)
while step < 100000:
    step += 1
    state = update(state)
    time.sleep(0.005)
    if stopper.should_stop(step):
        assert ck.save(step, state, {"pos": step}, {"stopped_by": "SIGTERM"})
        ck.close()
        print("STOPPED", step, flush=True)
        sys.exit(0)
    if step % 40 == 0:
        ck.save(step, state, {"pos": step})
sys.exit(3)
"""


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(SIGTERM_CHILD)
    d = tmp_path / "ck"
    p = subprocess.Popen([sys.executable, str(script), str(d)], env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "READY"
        time.sleep(0.5)
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        elapsed = time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err[-3000:]
    assert elapsed < 20
    step = int(out.split("STOPPED")[1].split()[0])
    state, data, meta = Checkpointer(d).restore()
    assert meta["step"] == step and meta["stopped_by"] == "SIGTERM" and data == {"pos": step}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full((64,), float(step)))
