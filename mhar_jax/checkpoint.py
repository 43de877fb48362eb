"""Checkpointing for mhar_jax: Orbax ``CheckpointManager`` + robust restore.

A checkpoint at step ``s`` is the directory ``<dir>/<s>/`` holding three items:

``state``
    pytree of jax arrays (params, optimiser state, step counter, RNG keys,
    typed or raw key data).  Saved with Orbax ``StandardSave``: every process
    writes the shards it owns; restore reshards to the ``.sharding`` of the
    ``jax.ShapeDtypeStruct`` leaves of ``abstract_state`` (see
    :func:`abstract_like`).
``data``
    the data-iterator state, a JSON-serialisable dict or ``bytes``; one file
    per process (``process_<i>.json``) because each process iterates its own
    shard of the data.
``meta``
    JSON: whatever the trainer passes (by convention ``config``,
    ``fingerprint`` -- the model architecture, see :func:`check_compatible` --
    and ``tokens_seen``) plus ``step``, ``process_count``, ``saved_at_unix``.

Trainer call order::

    check_writable(ckpt_dir)                  # fail before compiling anything
    ckpt = Checkpointer(ckpt_dir, max_to_keep=3)
    stopper = PreemptionHandler(sync_every=10).install()  # after distributed.initialize
    if ckpt.latest_step() is not None:
        state, data_state, meta = ckpt.restore(
            abstract_state=abstract_like(state), expected_fingerprint=fp)
        loader.set_state(data_state); start = meta["step"] + 1
    for step in range(start, num_steps):
        state = train_step(state, next(loader))
        meta = {"config": cfg, "fingerprint": fp, "tokens_seen": n}
        if step % save_every == 0:
            ckpt.save(step, state, loader.get_state(), meta)   # async
        if stopper.should_stop(step):         # same answer on every process
            ckpt.save(step, state, loader.get_state(), meta)   # no-op if just saved
            break
    ckpt.close()                              # waits for the last async save
    # exit 0

In multi-process runs call :func:`mhar_jax.distributed.initialize` first;
every method here must then be called by all processes.

Orbax 0.12.8 behaviour this relies on (read from its source, exercised by the
tests): ``save`` blocks only for the device-to-host copy and directory set-up,
then writes in a background thread; the next ``save``/``wait``/``close`` waits
for it and re-raises its error.  On local/POSIX file systems a step is written
to ``<s>.orbax-checkpoint-tmp`` and only ``rename``-d to ``<s>`` after every
item is written (``AtomicRenameTemporaryPath``; on GCS a ``commit_success.txt``
marker is used instead), so a crash mid-save leaves a tmp directory that is
never listed as a step and is deleted when the next ``Checkpointer`` opens the
directory.  Old steps beyond ``max_to_keep`` are deleted only after the new
save has finished successfully, so a failed save never costs the previous one.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "CheckpointDirectoryError",
    "CheckpointSaveError",
    "NoValidCheckpointError",
    "Checkpointer",
    "PreemptionHandler",
    "abstract_like",
    "any_process",
    "check_compatible",
    "check_writable",
    "flatten_dict",
]

STATE, DATA, META = "state", "data", "meta"
_META_FILE = "meta.json"
_BYTES_KEY = "__bytes_b64__"


class CheckpointError(RuntimeError):
    """Base class of the errors raised here."""


class CheckpointDirectoryError(CheckpointError):
    """The checkpoint directory cannot be created or written."""


class CheckpointSaveError(CheckpointError):
    """A save (synchronous part or background write) failed."""


class NoValidCheckpointError(CheckpointError):
    """Checkpoints exist but none of them could be restored."""


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _is_local(path: str | os.PathLike) -> bool:
    return "://" not in os.fspath(path)


def check_writable(path: str | os.PathLike) -> epath.Path:
    """Creates ``path`` if needed and checks files can be written in it.

    Writes, fsyncs and deletes a small probe file (``os.access`` is not
    trustworthy for root or network file systems).  Remote paths (``gs://``)
    are returned unchecked.

    Args:
      path: the checkpoint directory.

    Returns:
      The directory as an absolute ``epath.Path``.

    Raises:
      CheckpointDirectoryError: naming the path and the OS error.
    """
    if not _is_local(path):
        return epath.Path(path)
    p = os.path.abspath(os.fspath(path))
    probe = os.path.join(p, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.makedirs(p, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointDirectoryError(
            f"checkpoint directory {p!r} is not writable: {type(e).__name__}: {e.strerror or e}"
        ) from e
    return epath.Path(p)


def abstract_like(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` tree (with each leaf's ``.sharding``) of ``tree``.

    Use it (or ``jax.eval_shape`` + shardings) as ``abstract_state`` so restore
    places every array with the sharding the training step expects.
    """

    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, (np.ndarray, np.generic)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    return jax.tree.map(leaf, tree)


def flatten_dict(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"num_layers": 12}}`` -> ``{"model.num_layers": 12}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten_dict(v, key + "."))
        else:
            out[key] = v
    return out


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = dataclasses.asdict(x)
    return json.loads(json.dumps(x, default=_json_default))


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer, np.floating, np.bool_)):
        return o.item()
    if isinstance(o, (np.ndarray, jax.Array)):
        return np.asarray(o).tolist()
    if isinstance(o, (tuple, set, frozenset)):
        return list(o)
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if hasattr(o, "to_dict"):  # ml_collections.ConfigDict
        return o.to_dict()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


_MISSING = "<missing>"


def latest_meta(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The ``meta`` of the newest finalised step under ``directory``, read as
    plain JSON without opening a manager (None when there is no checkpoint or
    its meta is unreadable; ``Checkpointer.restore`` then decides)."""
    root = epath.Path(directory)
    if not root.exists():
        return None
    steps = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True)
    for step in steps:
        try:
            return json.loads((root / str(step) / META / _META_FILE).read_text())
        except (OSError, ValueError):
            continue
    return None


def step_problem(step_dir: str | os.PathLike) -> str | None:
    """Why ``step_dir`` is not a finished checkpoint step (a file or item
    directory it lacks), or None when it is one."""
    d = epath.Path(step_dir)
    if not (d / "_CHECKPOINT_METADATA").exists():
        return "missing step metadata file _CHECKPOINT_METADATA"
    for item in (STATE, DATA, META):
        if not (d / item).is_dir():
            return f"missing item directory '{item}'"
    if not (d / STATE / "_METADATA").exists():
        return "missing state/_METADATA (pytree metadata)"
    if not (d / META / _META_FILE).exists():
        return f"missing meta/{_META_FILE}"
    return None


def read_params(step_dir: str | os.PathLike, abstract_params: Any) -> Any:
    """Only the ``params`` of a step's saved training state, read without
    opening a manager (which would clean temporary directories of a run that
    may still be saving) and without reading the optimiser state.

    ``abstract_params``: a tree of ``jax.ShapeDtypeStruct`` with shardings,
    keyed like the saved tree; the arrays come back in those shardings.
    """
    item = {"params": abstract_params}
    with ocp.PyTreeCheckpointer() as ckptr:
        r = ckptr.restore(os.path.join(os.fspath(step_dir), STATE),
                          args=ocp.args.PyTreeRestore(
                              item=item,
                              restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                              partial_restore=True))
    return r["params"]


def check_compatible(meta: Mapping[str, Any], expected_fingerprint: Mapping[str, Any]) -> None:
    """Checks that a checkpoint was written for the same model architecture.

    Args:
      meta: the checkpoint's ``meta`` dict (as returned by ``restore``); its
        ``"fingerprint"`` entry is compared (a bare fingerprint dict without
        that key is accepted too).
      expected_fingerprint: the fingerprint of the current config, a (nested)
        JSON-like dict, e.g. ``{"model": {"num_layers": 24, "d_model": 1024}}``.
        Its keys are the ones compared: a key only the checkpoint holds (one
        an older fingerprint included) is not.

    Raises:
      ValueError: listing every differing key, e.g.
        ``model.num_layers: checkpoint 12, config 24``.
    """
    saved = meta.get("fingerprint", meta) if isinstance(meta, Mapping) else meta
    if saved is None:
        raise ValueError("checkpoint meta has no 'fingerprint'; cannot check the architecture")
    a = flatten_dict(_jsonable(saved))
    b = flatten_dict(_jsonable(expected_fingerprint))
    diffs = [
        f"{k}: checkpoint {a.get(k, _MISSING)}, config {b[k]}"
        for k in sorted(b)
        if a.get(k, _MISSING) != b[k]
    ]
    if diffs:
        raise ValueError(
            "checkpoint was written for a different model architecture: " + "; ".join(diffs)
        )


def any_process(flag: bool) -> bool:
    """True on every process if ``flag`` is True on any process.

    A collective (``multihost_utils.process_allgather``): every process must
    call it at the same point.  Free in single-process runs.
    """
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(bool(flag)))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _short(e: BaseException, limit: int = 300) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if len(msg) > limit:
        msg = msg[:limit] + "..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


# --------------------------------------------------------------------------
# Checkpointer
# --------------------------------------------------------------------------


class Checkpointer:
    """Asynchronous, atomic, keep-newest-N checkpoints of (state, data, meta).

    All methods must be called by every process (Orbax synchronises them).

    Args:
      directory: checkpoint root; created if missing, checked writable.
      max_to_keep: keep the newest N steps (None = keep all).
      async_save: write in a background thread (default).  False = ``save``
        returns only when the checkpoint is on disk.
      save_timeout_secs: bound on one background save (Orbax async timeout).
      quarantine_corrupt: when ``restore`` skips unusable newer steps and
        restores an older one, rename the skipped ones to
        ``<step>.corrupt-<unix time>`` so they are neither listed, kept in
        place of good steps by ``max_to_keep``, nor in the way of re-saving
        those step numbers.  (Nothing is renamed if no step restores.)
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        save_timeout_secs: int = 600,
        quarantine_corrupt: bool = True,
    ):
        self.directory = check_writable(directory)
        self._quarantine = quarantine_corrupt
        self._async = async_save
        self._pending: int | None = None
        self._pid = jax.process_index()
        # No policy keeps every step (PreserveAll is not exported by Orbax 0.12.8).
        policy = {} if max_to_keep is None else {
            "preservation_policy": ocp.checkpoint_managers.LatestN(n=max_to_keep)}
        options = ocp.CheckpointManagerOptions(
            **policy,
            enable_async_checkpointing=async_save,
            async_options=ocp.AsyncOptions(timeout_secs=int(save_timeout_secs)),
            cleanup_tmp_directories=True,  # drop leftovers of crashed saves
            create=True,
        )
        handlers = {
            STATE: ocp.StandardCheckpointHandler(),
            # Per-process file: each process has its own iterator position.
            DATA: ocp.JsonCheckpointHandler(
                filename=f"process_{self._pid}.json",
                multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None),
            ),
            META: ocp.JsonCheckpointHandler(filename=_META_FILE),
        }
        try:
            self._mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        except OSError as e:
            raise CheckpointDirectoryError(
                f"cannot open checkpoint directory {str(self.directory)!r}: {_short(e)}"
            ) from e

    # -- queries ------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Finalised steps on disk, ascending (not validated)."""
        self._mngr.reload()
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        """Newest finalised step on disk, or None (not validated; see restore)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    # -- save ---------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        data_state: Mapping[str, Any] | bytes | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> bool:
        """Starts saving ``(state, data_state, meta)`` as step ``step``.

        Returns after the device-to-host copy (async mode); ``state`` may be
        donated/overwritten afterwards.  First waits for the previous save and
        raises its error, if any.

        Args:
          step: training step (the directory name).
          state: pytree of jax arrays (or numpy / Python scalars).  In
            multi-process runs every ``jax.Array`` must be a global array
            (e.g. ``NamedSharding`` over the global mesh, ``P()`` for
            replicated scalars such as the step counter), not a host-local
            single-device array.
          data_state: data-iterator state, JSON-serialisable dict or bytes.
          meta: JSON-serialisable dict (config, fingerprint, tokens_seen...).

        Returns:
          True if a save was started, False if ``step`` already exists.

        Raises:
          CheckpointSaveError: this save or the previous background save
            failed (e.g. disk full).  Existing checkpoints are left intact.
          TypeError: ``data_state``/``meta`` is not JSON serialisable.
        """
        step = int(step)
        self.wait()
        if step in self._mngr.all_steps():
            logger.info("checkpoint step %d already exists in %s; not saving again", step, self.directory)
            return False
        meta_json = _jsonable(dict(meta or {}))
        meta_json.update(
            step=step,
            process_count=jax.process_count(),
            saved_at_unix=time.time(),
            mhar_checkpoint_format=1,
        )
        if isinstance(data_state, (bytes, bytearray, memoryview)):
            data_json = {_BYTES_KEY: base64.b64encode(bytes(data_state)).decode("ascii")}
        else:
            data_json = _jsonable(dict(data_state or {}))
        args = ocp.args.Composite(
            **{
                STATE: ocp.args.StandardSave(state),
                DATA: ocp.args.JsonSave(data_json),
                META: ocp.args.JsonSave(meta_json),
            }
        )
        try:
            # force=True: the trainer decides when to save (no save_interval
            # filtering); Orbax still refuses to overwrite an existing step.
            self._mngr.save(step, args=args, force=True)
        except Exception as e:
            self._after_failure()
            raise CheckpointSaveError(
                f"saving checkpoint step {step} to {str(self.directory)!r} failed: {_short(e)}; "
                f"earlier checkpoints are untouched (latest: {self.latest_step()})"
            ) from e
        self._pending = step if self._async else None
        logger.info("checkpoint step %d: save started in %s", step, self.directory)
        return True

    def wait(self) -> None:
        """Blocks until the pending background save is on disk.

        Raises:
          CheckpointSaveError: the background save failed; the step was not
            committed and earlier checkpoints are untouched.
        """
        pending, self._pending = self._pending, None
        try:
            self._mngr.wait_until_finished()
        except Exception as e:
            self._after_failure()
            raise CheckpointSaveError(
                f"asynchronous save of checkpoint step {pending} to {str(self.directory)!r} failed: "
                f"{_short(e)}; that step was not committed, earlier checkpoints are untouched "
                f"(latest: {self.latest_step()})"
            ) from e

    def _after_failure(self) -> None:
        # Resync Orbax's step list from disk: it dropped the failed step and
        # the old steps it meant to delete from its in-memory list, but (as the
        # save failed) deleted nothing.  The failed step's
        # ``<step>.orbax-checkpoint-tmp`` directory is not touched here (Orbax
        # threads may still hold it); Orbax removes it when that step is
        # saved again or the next Checkpointer opens the directory.
        try:
            self._mngr.reload()
        except Exception:  # pragma: no cover - best effort
            logger.exception("reloading checkpoint list after a failed save")

    def close(self) -> None:
        """Waits for the pending save (raising its error) and releases Orbax."""
        try:
            self.wait()
        finally:
            self._mngr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restore ------------------------------------------------------------

    def _structure_problem(self, step: int) -> str | None:
        return step_problem(self._step_dir(step))

    def _read_meta(self, step: int) -> dict[str, Any]:
        meta = json.loads((self._step_dir(step) / META / _META_FILE).read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"meta/{_META_FILE} is not a JSON object")
        if meta.get("step", step) != step:
            raise ValueError(f"meta says step {meta.get('step')} but directory is step {step}")
        return meta

    def _restore_step(self, step: int, abstract_state: Any, restore_data: bool) -> tuple[Any, Any]:
        items = {STATE: ocp.args.StandardRestore(abstract_state)}
        if restore_data:
            items[DATA] = ocp.args.JsonRestore()
        r = self._mngr.restore(step, args=ocp.args.Composite(**items))
        data = r[DATA] if restore_data else None
        if isinstance(data, dict) and set(data) == {_BYTES_KEY}:
            data = base64.b64decode(data[_BYTES_KEY])
        return r[STATE], data

    def restore(
        self,
        step: int | None = None,
        abstract_state: Any = None,
        *,
        expected_fingerprint: Mapping[str, Any] | None = None,
        restore_data: bool = True,
    ) -> tuple[Any, Any, dict[str, Any]]:
        """Restores ``(state, data_state, meta)``.

        With ``step=None`` tries the newest step first; a step that is
        corrupt or partial (missing item directory or metadata, truncated or
        unreadable file, ...) is skipped with a warning naming the step and the
        reason, and the next newest is tried.

        Args:
          step: a specific step (no fallback), or None for the newest usable.
          abstract_state: pytree of ``jax.ShapeDtypeStruct`` with
            ``.sharding`` (see :func:`abstract_like`); arrays are restored with
            those shardings.  None restores as saved (single process only).
          expected_fingerprint: if given, :func:`check_compatible` is run on
            each candidate's meta before reading the arrays.
          restore_data: also restore this process's data-iterator state
            (requires the same process count as at save time).

        Returns:
          ``(state, data_state, meta)``; ``data_state`` is a dict, bytes, or
          None if ``restore_data=False``.

        Raises:
          FileNotFoundError: no checkpoint (or not ``step``) in the directory.
          ValueError: architecture or process-count mismatch (not skipped:
            every checkpoint of a run shares them).
          NoValidCheckpointError: every candidate was unusable.
        """
        self.wait()
        steps = sorted(self.all_steps(), reverse=True)
        if step is not None:
            if int(step) not in steps:
                raise FileNotFoundError(f"no checkpoint step {step} in {self.directory} (have {sorted(steps)})")
            candidates = [int(step)]
        else:
            if not steps:
                raise FileNotFoundError(f"no checkpoints in {self.directory}")
            candidates = steps

        skipped: list[tuple[int, str]] = []
        for s in candidates:
            reason = self._structure_problem(s)
            meta = None
            if reason is None:
                try:
                    meta = self._read_meta(s)
                except Exception as e:  # noqa: BLE001
                    reason = f"unreadable meta: {_short(e)}"
            if reason is None:
                # Mismatches are configuration errors, not corruption: raise.
                if expected_fingerprint is not None:
                    check_compatible(meta, expected_fingerprint)
                saved_n = meta.get("process_count", jax.process_count())
                if restore_data and saved_n != jax.process_count():
                    raise ValueError(
                        f"checkpoint step {s} was written by {saved_n} processes, this run has "
                        f"{jax.process_count()}: the per-process data-iterator state cannot be "
                        "mapped; pass restore_data=False to restore only state and meta"
                    )
                if restore_data and not (self._step_dir(s) / DATA / f"process_{self._pid}.json").exists():
                    reason = f"missing data/process_{self._pid}.json"
            result = None
            # Collective agreement before and after reading the arrays, so that
            # all processes attempt (and accept) the same step.
            if not any_process(reason is not None):
                try:
                    result = self._restore_step(s, abstract_state, restore_data)
                except Exception as e:  # noqa: BLE001 - any failure means unusable
                    reason = _short(e)
            elif reason is None:
                reason = "unusable on another process"
            if any_process(reason is not None):
                reason = reason or "unusable on another process"
                logger.warning(
                    "checkpoint step %d in %s is unusable (%s); skipping it%s",
                    s, self.directory, reason,
                    "" if step is not None else ", falling back to an older checkpoint",
                )
                skipped.append((s, reason))
                continue
            assert result is not None and meta is not None
            if skipped:
                logger.warning(
                    "restored checkpoint step %d after skipping unusable newer step(s) %s",
                    s, ", ".join(str(k) for k, _ in skipped),
                )
                if self._quarantine:
                    self._quarantine_steps([k for k, _ in skipped])
            state, data = result
            return state, data, meta

        detail = "; ".join(f"step {k}: {r}" for k, r in skipped)
        logger.error("no usable checkpoint in %s (%s)", self.directory, detail)
        raise NoValidCheckpointError(f"no usable checkpoint in {str(self.directory)!r}: {detail}")

    def _quarantine_steps(self, steps: Iterable[int]) -> None:
        if self._pid == 0:
            for s in steps:
                src = self._step_dir(s)
                dst = self.directory / f"{s}.corrupt-{int(time.time())}"
                try:
                    src.rename(dst)
                    logger.warning("moved unusable checkpoint %s to %s", src, dst)
                except OSError as e:
                    logger.warning("could not move unusable checkpoint %s aside: %s", src, e)
        _barrier("mhar_checkpoint_quarantine")
        self._mngr.reload()


# --------------------------------------------------------------------------
# Pre-emption
# --------------------------------------------------------------------------


class PreemptionHandler:
    """Turns SIGTERM/SIGINT into a stop flag that the training loop polls.

    ``should_stop(step)`` is called every step.  Single process: returns the
    local flag.  Multi-process: all processes must stop at the same step, so
    the flags are OR-reduced with :func:`any_process` (one tiny allgather)
    only at steps divisible by ``sync_every``, and ``should_stop`` returns
    False in between; a stop is thus honoured at most ``sync_every - 1``
    steps late.  When ``jax.distributed`` is initialised, jax's own
    preemption sync point (``multihost_utils.reached_preemption_sync_point``,
    agreed through the coordination service, no collective) is also
    consulted each step.  Once True, ``should_stop`` stays True.

    Install after ``distributed.initialize``: jax's coordination service
    registers its own SIGTERM notifier there, and whichever is installed last
    receives SIGTERM (either way the agreed step is the same on all
    processes).  A second SIGINT raises ``KeyboardInterrupt`` (hard stop).

    Args:
      signals: signals to catch.
      sync_every: cross-process agreement period in steps (multi-process).
    """

    def __init__(
        self,
        signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT),
        sync_every: int = 10,
    ):
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        self.signals = tuple(signals)
        self.sync_every = int(sync_every)
        self.received: int | None = None  # number of the first signal caught
        self._local = False
        self._stopped = False
        self._previous: dict[int, Any] = {}

    def install(self) -> PreemptionHandler:
        """Installs the handlers (main thread only); returns self."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must be called from the main thread")
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        """Restores the previous handlers."""
        for s, h in self._previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum, frame) -> None:
        if self._local and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signum
        self._local = True

    def request_stop(self) -> None:
        """Sets the local flag programmatically (e.g. a wall-clock limit)."""
        self._local = True

    @property
    def stop_requested(self) -> bool:
        """This process's flag (no cross-process agreement)."""
        return self._local

    def should_stop(self, step: int | None = None) -> bool:
        """True when the loop should save and exit; agreed across processes.

        Args:
          step: current step.  Multi-process: every process must pass the same
            step sequence; None makes every call a synchronisation point.
        """
        if self._stopped:
            return True
        if jax.process_count() == 1:
            stop = self._local
        else:
            stop = False
            if step is not None and jax.distributed.is_initialized():
                from jax.experimental import multihost_utils

                try:
                    stop = multihost_utils.reached_preemption_sync_point(int(step))
                except RuntimeError:  # jax preemption service disabled
                    stop = False
            if step is None or int(step) % self.sync_every == 0:
                stop = any_process(self._local) or stop
        if stop:
            self._stopped = True
            name = signal.Signals(self.received).name if self.received else "request"
            logger.warning("stop requested (%s); stopping at step %s", name, step)
        return stop
