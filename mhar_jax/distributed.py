"""Multi-process (multi-host) start-up for mhar_jax.

Call :func:`initialize` once, first thing in the training script, before any
other JAX call (``jax.devices()``, ``jnp.ones`` ... all initialise the backend
and make ``jax.distributed.initialize`` impossible)::

    from mhar_jax import distributed
    info = distributed.initialize(heartbeat_timeout=60)
    logging.info(distributed.describe())

How the process group is found (first match wins; :func:`detect_cluster` is the
pure-function part and can be tested with a fake environment):

1. Explicit arguments ``coordinator_address`` / ``num_processes`` /
   ``process_id`` (all three, or none).
2. Generic / Kubernetes: ``MHAR_COORDINATOR_ADDRESS`` or
   ``JAX_COORDINATOR_ADDRESS`` (``host:port``) together with
   ``MHAR_NUM_PROCESSES``/``JAX_NUM_PROCESSES`` and
   ``MHAR_PROCESS_ID``/``JAX_PROCESS_ID``.  For a Kubernetes Indexed Job set
   the address to the headless-service name of pod 0 and the id from
   ``JOB_COMPLETION_INDEX`` (also read as a fallback for the process id).
3. SLURM: ``SLURM_JOB_ID`` set and ``SLURM_NTASKS > 1``; rank
   ``SLURM_PROCID``; coordinator = first host of ``SLURM_STEP_NODELIST``
   (falling back to ``SLURM_JOB_NODELIST``), port ``MHAR_COORDINATOR_PORT`` /
   ``JAX_COORDINATOR_PORT`` or, like jax, ``61440 + SLURM_JOB_ID % 4096``.
   With several tasks per node each process gets ``local_device_ids =
   [SLURM_LOCALID]`` (one GPU per task, as jax does).
4. Open MPI (``mpirun``): ``OMPI_COMM_WORLD_SIZE > 1``, rank
   ``OMPI_COMM_WORLD_RANK``; coordinator from ``MHAR_COORDINATOR_ADDRESS`` /
   ``JAX_COORDINATOR_ADDRESS``, else the launcher IP in
   ``OMPI_MCA_orte_hnp_uri`` (as jax does) with port ``MHAR_COORDINATOR_PORT``
   / ``JAX_COORDINATOR_PORT`` or jax's job-id-derived default.  Other MPIs:
   pass ``cluster_detection_method="mpi4py"``.
5. Otherwise single process: :func:`initialize` is a no-op.

``cluster_detection_method`` (e.g. ``"mpi4py"``, ``"gke"``, ``"gce"``,
``"k8s"``) hands detection entirely to jax's own auto-detection
(``jax/_src/clusters``), which also covers Cloud TPU and the Kubernetes API.

Fault tolerance.  jax 0.10.2's coordination service makes every process send
heartbeats; when a peer has been silent for ``heartbeat_timeout`` seconds the
survivors are terminated with an error (the process aborts with SIGABRT after
logging "Terminating process because the JAX distributed service detected
fatal errors"; it does not hang).  If the coordinator (process 0) dies, the
others notice at once from the broken connection.
``initialization_timeout`` bounds the wait for all peers to connect, and
``shutdown_timeout`` bounds the barrier in ``jax.distributed.shutdown()`` (run
at interpreter exit) when a peer never arrives.

CPU.  On CPU, cross-process collectives need an implementation; this module sets
``jax_cpu_collectives_implementation="gloo"`` before initialising (unless the
user already chose one, e.g. ``"mpi"``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax

logger = logging.getLogger(__name__)

__all__ = [
    "ClusterSpec",
    "DistributedInfo",
    "detect_cluster",
    "first_slurm_host",
    "initialize",
    "describe",
    "shutdown",
]


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Resolved arguments for ``jax.distributed.initialize``.

    ``source`` names where they came from: ``"explicit"``, ``"env"``,
    ``"slurm"``, ``"ompi"`` or ``"jax:<method>"`` (delegated to jax's
    auto-detection, in which case the other fields may be None).
    """

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None = None
    source: str = "explicit"


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """What :func:`initialize` set up (read back from jax after start-up)."""

    process_index: int
    process_count: int
    local_devices: tuple[Any, ...]
    global_devices: tuple[Any, ...]
    coordinator_address: str | None
    source: str  # "single" when no distributed runtime was started

    @property
    def is_multiprocess(self) -> bool:
        return self.process_count > 1

    @property
    def is_primary(self) -> bool:
        return self.process_index == 0


_INFO: DistributedInfo | None = None


# --------------------------------------------------------------------------
# Environment parsing (pure functions)
# --------------------------------------------------------------------------


def first_slurm_host(nodelist: str) -> str:
    """First host name of a SLURM compressed node list.

    ``"node[01-03],gpu7"`` -> ``"node01"``, ``"gpu7,node2"`` -> ``"gpu7"``,
    ``"a[007,010-012]"`` -> ``"a007"``, ``"rack1-n[3-4]"`` -> ``"rack1-n3"``.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("empty SLURM node list")
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist)
    assert m is not None  # the pattern matches any string
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        if not prefix:
            raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
        return prefix
    first = re.split(r"[,-]", ranges, maxsplit=1)[0].strip()
    if not first:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    return prefix + first


def _get(env: Mapping[str, str], *names: str) -> str | None:
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            return v
    return None


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError) as e:
        raise ValueError(f"environment variable {name}={env.get(name)!r} is not an integer") from e


def _default_port(job_id: int) -> int:
    # Same formula as jax/_src/clusters/slurm_cluster.py: ephemeral range
    # [61440, 65535], derived from the job id so all tasks agree.
    return job_id % 2**12 + (65535 - 2**12 + 1)


def _local_ids(env: Mapping[str, str]) -> tuple[int, ...] | None:
    v = _get(env, "MHAR_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS")
    return tuple(int(x) for x in v.split(",")) if v else None


def detect_cluster(env: Mapping[str, str] | None = None) -> ClusterSpec | None:
    """Detects a multi-process launch from environment variables.

    Args:
      env: the environment to read (default ``os.environ``).

    Returns:
      A :class:`ClusterSpec` for a launch with more than one process, or None
      for a single-process run.  See the module docstring for the order and
      the variables read.

    Raises:
      ValueError: the environment describes a multi-process launch but a
        needed value is missing or malformed.
    """
    env = os.environ if env is None else env
    port_override = _get(env, "MHAR_COORDINATOR_PORT", "JAX_COORDINATOR_PORT")
    addr = _get(env, "MHAR_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")

    # 1. Generic / Kubernetes.
    nproc = _get(env, "MHAR_NUM_PROCESSES", "JAX_NUM_PROCESSES")
    if addr is not None and nproc is not None:
        n = int(nproc)
        pid = _get(env, "MHAR_PROCESS_ID", "JAX_PROCESS_ID", "JOB_COMPLETION_INDEX")
        if pid is None:
            raise ValueError(
                "JAX_NUM_PROCESSES/MHAR_NUM_PROCESSES is set but no process id: set "
                "MHAR_PROCESS_ID or JAX_PROCESS_ID (or JOB_COMPLETION_INDEX)"
            )
        if n <= 1:
            return None
        return ClusterSpec(addr, n, int(pid), _local_ids(env), "env")

    # 2. SLURM (only when more than one task; a 1-task job is single process).
    if "SLURM_JOB_ID" in env and "SLURM_NTASKS" in env:
        n = _int(env, "SLURM_NTASKS")
        if n > 1:
            if "SLURM_PROCID" not in env:
                raise ValueError("SLURM_NTASKS>1 but SLURM_PROCID is not set (launch with srun)")
            pid = _int(env, "SLURM_PROCID")
            if addr is None:
                nodelist = _get(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                if nodelist is None:
                    raise ValueError(
                        "SLURM multi-task job without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST; "
                        "set MHAR_COORDINATOR_ADDRESS=host:port"
                    )
                port = port_override or str(_default_port(_int(env, "SLURM_JOB_ID")))
                addr = f"{first_slurm_host(nodelist)}:{port}"
            local = _local_ids(env)
            nnodes = _get(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
            if local is None and nnodes is not None and "SLURM_LOCALID" in env and n > int(nnodes):
                local = (_int(env, "SLURM_LOCALID"),)  # several tasks per node: 1 device each
            return ClusterSpec(addr, n, pid, local, "slurm")

    # 3. Open MPI.
    if "OMPI_COMM_WORLD_SIZE" in env:
        n = _int(env, "OMPI_COMM_WORLD_SIZE")
        if n > 1:
            pid = _int(env, "OMPI_COMM_WORLD_RANK")
            if addr is None:
                uri = env.get("OMPI_MCA_orte_hnp_uri")
                if not uri:
                    raise ValueError(
                        "Open MPI launch (OMPI_COMM_WORLD_SIZE>1) without a coordinator: set "
                        "MHAR_COORDINATOR_ADDRESS=host:port (host = the node of rank 0), "
                        "or launch with Open MPI's mpirun so OMPI_MCA_orte_hnp_uri is set"
                    )
                # Like jax/_src/clusters/ompi_cluster.py.
                m = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
                if m is None:
                    raise ValueError(f"cannot parse launcher IP from OMPI_MCA_orte_hnp_uri={uri!r}")
                ip = next(g for g in m.groups() if g is not None)
                port = port_override or str(_default_port(int(uri.split(".", 1)[0]) // 2**12))
                addr = f"{ip}:{port}"
            local = _local_ids(env)
            lsize = env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
            if local is None and lsize and int(lsize) > 1 and "OMPI_COMM_WORLD_LOCAL_RANK" in env:
                local = (_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),)
            return ClusterSpec(addr, n, pid, local, "ompi")

    return None


# --------------------------------------------------------------------------
# Start-up
# --------------------------------------------------------------------------


def _enable_cpu_collectives() -> None:
    """Selects gloo for cross-process CPU collectives (keeps an explicit "mpi")."""
    current = jax.config.jax_cpu_collectives_implementation
    if current in ("mpi", "megascale"):
        logger.info("keeping jax_cpu_collectives_implementation=%s", current)
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _read_info(source: str, address: str | None) -> DistributedInfo:
    return DistributedInfo(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=tuple(jax.local_devices()),
        global_devices=tuple(jax.devices()),
        coordinator_address=address,
        source=source,
    )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout: int = 100,
    shutdown_timeout: int = 300,
    cluster_detection_method: str | None = None,
    env: Mapping[str, str] | None = None,
) -> DistributedInfo:
    """Starts the JAX distributed runtime if this is a multi-process launch.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator service.
        Give it with ``num_processes`` and ``process_id`` to skip detection.
      num_processes: total number of processes.
      process_id: this process's rank in ``[0, num_processes)``.
      local_device_ids: restrict this process to these local accelerator ids.
      initialization_timeout: seconds to wait for all processes to connect
        before failing (jax ``initialization_timeout``).
      heartbeat_timeout: seconds without heartbeats after which a peer counts
        as dead and the surviving processes are terminated with an error
        (jax ``heartbeat_timeout_seconds``).  Smaller = faster failure,
        but must exceed the longest stall (e.g. a long compile or GC pause).
      shutdown_timeout: seconds the exit barrier waits for peers
        (jax ``shutdown_timeout_seconds``).
      cluster_detection_method: delegate detection to jax (``"mpi4py"``,
        ``"gke"``, ``"gce"``, ``"k8s"``, ``"slurm"``, ``"ompi"``).
      env: environment to read instead of ``os.environ`` (for tests).

    Returns:
      A :class:`DistributedInfo`.  Calling again returns the first result.

    Raises:
      ValueError: only some of the three explicit arguments were given, or the
        environment is inconsistent.
      RuntimeError: the JAX backend was already initialised.

    If the peers do not all connect within ``initialization_timeout``, or one
    dies later, jax's coordination client terminates this process (SIGABRT,
    exit status 134 from a shell) with a log line naming the failure.
    """
    global _INFO
    if _INFO is not None:
        return _INFO
    if jax.distributed.is_initialized():  # someone called jax directly
        _INFO = _read_info("external", None)
        return _INFO

    explicit = (coordinator_address, num_processes, process_id)
    if cluster_detection_method is not None:
        spec = ClusterSpec(
            coordinator_address, num_processes, process_id,
            None if local_device_ids is None else tuple(_as_id_list(local_device_ids)),
            f"jax:{cluster_detection_method}",
        )
    elif all(v is not None for v in explicit):
        spec = ClusterSpec(
            coordinator_address, int(num_processes), int(process_id),
            None if local_device_ids is None else tuple(_as_id_list(local_device_ids)),
            "explicit",
        )
        if spec.num_processes == 1:
            spec = None
    elif any(v is not None for v in explicit):
        raise ValueError(
            "give all of coordinator_address, num_processes and process_id, or none "
            f"(got coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
            f"process_id={process_id!r})"
        )
    else:
        spec = detect_cluster(env)
        if spec is not None and local_device_ids is not None:
            spec = dataclasses.replace(spec, local_device_ids=tuple(_as_id_list(local_device_ids)))

    if spec is None:
        _INFO = _read_info("single", None)
        return _INFO

    _enable_cpu_collectives()
    logger.info(
        "jax.distributed.initialize via %s: coordinator=%s num_processes=%s process_id=%s "
        "local_device_ids=%s heartbeat_timeout=%ss",
        spec.source, spec.coordinator_address, spec.num_processes, spec.process_id,
        spec.local_device_ids, heartbeat_timeout,
    )
    jax.distributed.initialize(
        coordinator_address=spec.coordinator_address,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        local_device_ids=None if spec.local_device_ids is None else list(spec.local_device_ids),
        cluster_detection_method=cluster_detection_method,
        initialization_timeout=int(initialization_timeout),
        heartbeat_timeout_seconds=int(heartbeat_timeout),
        shutdown_timeout_seconds=int(shutdown_timeout),
    )
    address = spec.coordinator_address
    if address is None:  # resolved by jax's own detection
        from jax._src import distributed as _jax_distributed  # private, read-only use

        address = _jax_distributed.global_state.coordinator_address
    _INFO = _read_info(spec.source, address)
    return _INFO


def _as_id_list(ids: int | Sequence[int]) -> list[int]:
    """``ids`` as a list of ints (an int becomes a one-element list)."""
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def shutdown() -> None:
    """Shuts the distributed runtime down (also done by jax at exit)."""
    global _INFO
    jax.distributed.shutdown()
    _INFO = None


def describe() -> str:
    """One-line description of the process group and devices, for logging."""
    info = _INFO if _INFO is not None else _read_info("single", None)
    kinds = sorted({d.device_kind for d in info.global_devices})
    return (
        f"process {info.process_index}/{info.process_count} "
        f"(via {info.source}{', coordinator ' + info.coordinator_address if info.coordinator_address else ''}); "
        f"{len(info.local_devices)} local / {len(info.global_devices)} global devices "
        f"[{jax.default_backend()}: {', '.join(kinds)}]; "
        f"local ids {[d.id for d in info.local_devices]}"
    )
