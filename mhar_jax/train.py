"""Train a decoder: ``python -m mhar_jax.train --config=configs/X.py --workdir=DIR``.

Override any config key on the command line (``--config.model.residual=mhar
--config.train.steps=100``). ``--dry_run`` compiles the train step for the
configured mesh and prints parameters, FLOPs per token and XLA's per-device
memory estimate without training (``--dry_run_devices=8`` simulates 8 CPU
devices). Multi-host: ``jax.distributed`` is initialised from SLURM / Open MPI
/ Kubernetes environments or from ``--coordinator_address --num_processes
--process_id``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/tiny.py", "Experiment config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, TensorBoard events and logs"
                    " (default: ./workdirs/<config name>).")
flags.DEFINE_bool("dry_run", False, "Compile the train step and print the plan;"
                  " do not train.")
flags.DEFINE_integer("dry_run_devices", 0, "With --dry_run: simulate this many"
                     " CPU devices.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Number of processes.")
flags.DEFINE_integer("process_id", None, "This process's rank.")
flags.DEFINE_integer("heartbeat_timeout", 100, "Seconds without a heartbeat"
                     " before a peer counts as dead.")
FLAGS = flags.FLAGS


def say(msg: str):
  """Console output of process 0."""
  import jax
  if jax.process_index() == 0:
    print(msg, flush=True)


def fmt_time(s: float) -> str:
  s = int(max(s, 0))
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else \
      f"{s // 60}m{s % 60:02d}s"


def default_workdir(config_path: str) -> str:
  name = os.path.splitext(os.path.basename(config_path or "config"))[0]
  return os.path.join("workdirs", name)


def resolve_data(cfg, model_cfg):
  """Checks the data config before anything is compiled; returns the data dir."""
  from mhar_jax.data import check_data_dir, resolve_data_dir
  data_dir = resolve_data_dir(cfg.data.data_dir)
  meta = check_data_dir(data_dir, cfg.data.train_split)
  if meta["vocab_size"] > model_cfg.vocab_size:
    raise ValueError(
        f"data.data_dir={cfg.data.data_dir!r}: its tokenizer has"
        f" {meta['vocab_size']} tokens, more than"
        f" model.vocab_size={model_cfg.vocab_size}.")
  need = cfg.train.global_batch * cfg.train.seq_len + 1
  if meta["num_tokens"] < need:
    raise ValueError(
        f"data.train_split={cfg.data.train_split!r} has {meta['num_tokens']}"
        f" tokens, fewer than one global batch ({need}).")
  for split in cfg.data.val_splits:
    check_data_dir(data_dir, split, split_key="data.val_splits")
  return data_dir


class Trainer:
  """Owns mesh, state, data, checkpoints and logs for one run."""

  def __init__(self, cfg, model_cfg, workdir: str, data_dir: str,
               devices=None):
    import jax
    from mhar_jax import checkpoint, parallel, training
    from mhar_jax.config import mesh_shape
    from mhar_jax.layers import ROUTED
    from mhar_jax.summary import SummaryWriter

    self.cfg, self.model_cfg, self.workdir = cfg, model_cfg, workdir
    self.data_dir = data_dir
    devices = devices if devices is not None else jax.devices()
    data, model = mesh_shape(cfg, len(devices))
    self.mesh = parallel.make_mesh(data, model, devices)
    self.tx = training.make_optimizer(cfg.train)
    self.gdef = training.graphdef(model_cfg)
    self.state_sh = training.state_shardings_for(model_cfg, self.tx, self.mesh)
    self.batch_sh = parallel.batch_sharding(self.mesh)
    self.train_step = training.make_train_step(self.gdef, self.tx, cfg.train,
                                               self.state_sh, self.batch_sh)
    self.eval_step = training.make_eval_step(self.gdef, self.state_sh["params"],
                                             self.batch_sh,
                                             cfg.train.loss_chunk_tokens)
    self.routing_stats = (
        training.make_routing_stats(self.gdef, self.state_sh["params"],
                                    self.batch_sh)
        if model_cfg.residual in ROUTED else None)
    self.ckpt = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"), max_to_keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save)
    self.writer = SummaryWriter(os.path.join(workdir, "tensorboard"),
                                enabled=jax.process_index() == 0)
    self.flops_per_token = training.flops_per_token(model_cfg,
                                                    cfg.train.seq_len)
    peak = training.peak_flops(jax.devices()[0])
    self.peak = peak * len(devices) if peak else None
    self.fingerprint = training.fingerprint(model_cfg)

  # -- data ---------------------------------------------------------------------

  def global_batch(self, local):
    import jax
    return {k: jax.make_array_from_process_local_data(self.batch_sh, v)
            for k, v in local.items()}

  def train_iterator(self):
    import jax
    from mhar_jax.data import make_train_iterator
    t = self.cfg.train
    return make_train_iterator(
        self.data_dir, self.cfg.data.train_split, seq_len=t.seq_len,
        global_batch=t.global_batch, seed=t.seed,
        process_index=jax.process_index(), process_count=jax.process_count(),
        worker_count=self.cfg.data.worker_count)

  def evaluate(self, params) -> dict[str, float]:
    """Validation loss and bits per byte on every ``data.val_splits`` split."""
    import jax
    import numpy as np
    from mhar_jax.data import bits_per_byte, bytes_per_token, make_eval_batches
    out = {}
    batch = self.cfg.eval.batch or self.cfg.train.global_batch
    for split in self.cfg.data.val_splits:
      losses = [self.eval_step(params, self.global_batch(b)) for b in
                make_eval_batches(self.data_dir, split,
                                  seq_len=self.cfg.train.seq_len, batch=batch,
                                  max_batches=self.cfg.eval.batches,
                                  process_index=jax.process_index(),
                                  process_count=jax.process_count())]
      if not losses:
        raise ValueError(f"data.val_splits: split {split!r} is shorter than one"
                         f" eval batch ({batch} x {self.cfg.train.seq_len}).")
      loss = float(np.mean(jax.device_get(losses)))
      out[f"{split}/loss"] = loss
      out[f"{split}/bpb"] = bits_per_byte(loss, bytes_per_token(self.data_dir,
                                                                split))
    return out

  # -- the loop -------------------------------------------------------------------

  def run(self, until: int | None = None) -> dict:
    """Trains to ``train.steps`` (or stops after step ``until``), resuming
    from the newest good checkpoint; returns the last eval, the logged train
    losses and the final state."""
    import jax
    import numpy as np
    from mhar_jax import checkpoint, training

    cfg, t = self.cfg, self.cfg.train
    it = self.train_iterator()
    start = 0
    if self.ckpt.latest_step() is not None:
      abstract = training.abstract_state(self.model_cfg, self.tx, self.state_sh)
      state, data_state, meta = self.ckpt.restore(
          abstract_state=abstract, expected_fingerprint=self.fingerprint)
      it.set_state(data_state)
      start = int(meta["step"])
      say(f"resumed from step {start} in {self.ckpt.directory}")
    else:
      t_init = time.time()
      state = training.init_state(self.model_cfg, self.tx, t.seed,
                                  self.state_sh)
      jax.block_until_ready(state)
      say(f"initialised the state (seed {t.seed}) in {time.time() - t_init:.1f}s")
    n_params = sum(int(x.size) for x in jax.tree.leaves(state["params"]))
    say(f"model: {self.model_cfg.residual}"
        f" (H={self.model_cfg.heads_per_site}, blocks="
        f"{self.model_cfg.num_blocks or 'full'}), {n_params / 1e6:.2f}M params,"
        f" mesh {dict(self.mesh.shape)}, {jax.process_count()} process(es)")

    stopper = checkpoint.PreemptionHandler(sync_every=10).install()
    tokens_per_step = t.global_batch * t.seq_len
    pending, history = [], []
    t0, last_t, last_step = time.time(), time.time(), start
    result = {}

    def meta(step):
      return {"config": json.loads(cfg.to_json_best_effort()),
              "fingerprint": self.fingerprint, "step": step,
              "tokens_seen": step * tokens_per_step}

    def save(step):
      self.ckpt.save(step, state, it.get_state(), meta(step))

    step = start
    try:
      end = min(t.steps, until or t.steps)
      while step < end:
        batch = self.global_batch(next(it))
        state, metrics = self.train_step(state, batch)
        step += 1
        pending.append(metrics)
        last = step == end
        if step % cfg.log.every == 0 or last:
          m = jax.device_get(pending)
          pending = []
          self._check_finite(m[-1], step, t)
          now = time.time()
          tok_s = (step - last_step) * tokens_per_step / max(now - last_t, 1e-9)
          last_t, last_step = now, step
          loss = float(np.mean([x["loss"] for x in m]))
          scalars = {"train/loss": loss, "train/lr": float(m[-1]["lr"]),
                     "train/grad_norm": float(m[-1]["grad_norm"]),
                     "train/tokens_per_s": tok_s,
                     "train/skipped_steps": float(m[-1]["skipped"])}
          if t.z_loss:
            scalars["train/z_loss"] = float(np.mean([x["z_loss"] for x in m]))
          if self.peak:
            scalars["train/mfu"] = tok_s * self.flops_per_token / self.peak
          self.writer.scalars(scalars, step)
          history.append((step, loss))
          eta = (t.steps - step) * (now - t0) / max(step - start, 1)
          mfu = f" mfu {scalars['train/mfu']:.1%}" if self.peak else ""
          say(f"step {step:6d}/{t.steps} loss {loss:.4f} lr"
              f" {scalars['train/lr']:.2e} gnorm {scalars['train/grad_norm']:.3f}"
              f" {tok_s:,.0f} tok/s{mfu} eta {fmt_time(eta)}")
        if self.routing_stats and (step % cfg.log.routing_every == 0 or last):
          ent = np.asarray(jax.device_get(self.routing_stats(
              state["params"], batch["inputs"])))
          self.writer.scalars({f"routing/entropy_site_{j:03d}": float(e)
                               for j, e in enumerate(ent)}, step)
        if step % cfg.eval.every == 0 or last:
          ev = self.evaluate(state["params"])
          self.writer.scalars({f"eval/{k}": v for k, v in ev.items()}, step)
          result = ev
          say(f"eval  {step:6d} " + "  ".join(f"{k} {v:.4f}"
                                              for k, v in ev.items()))
        if step % cfg.checkpoint.every == 0 or last:
          save(step)
        if stopper.should_stop(step):
          say(f"stop requested (signal {stopper.received}): saving step {step}"
              " and exiting")
          save(step)
          break
    finally:
      self.ckpt.close()
      self.writer.close()
      stopper.uninstall()
    result["train_history"] = history
    result["step"] = step
    result["state"] = state
    return result

  def _check_finite(self, m, step, t):
    skipped, run = int(m["skipped"]), int(m["consecutive_skips"])
    if t.nonfinite == "stop" and skipped:
      raise FloatingPointError(
          f"non-finite loss or gradients by step {step} ({skipped} update(s)"
          " skipped); stopping (train.nonfinite='stop'). Parameters were not"
          " updated by those steps; the last checkpoint is in"
          f" {self.ckpt.directory}. Set train.nonfinite='skip' to skip such"
          " steps instead.")
    if t.nonfinite == "skip" and run > t.max_consecutive_skips:
      raise FloatingPointError(
          f"{run} consecutive non-finite steps by step {step}, more than"
          f" train.max_consecutive_skips={t.max_consecutive_skips}; stopping."
          f" The last checkpoint is in {self.ckpt.directory}.")


def dry_run(cfg, model_cfg):
  """Compiles the train step abstractly and prints the plan."""
  import jax
  import jax.numpy as jnp
  from mhar_jax import parallel, training
  from mhar_jax.config import mesh_shape

  data, model = mesh_shape(cfg, jax.device_count())
  mesh = parallel.make_mesh(data, model)
  tx = training.make_optimizer(cfg.train)
  gdef = training.graphdef(model_cfg)
  state_sh = training.state_shardings_for(model_cfg, tx, mesh)
  batch_sh = parallel.batch_sharding(mesh)
  step = training.make_train_step(gdef, tx, cfg.train, state_sh, batch_sh)
  abstract = training.abstract_state(model_cfg, tx, state_sh)
  t = cfg.train
  batch = {k: jax.ShapeDtypeStruct((t.global_batch, t.seq_len), jnp.int32,
                                   sharding=batch_sh)
           for k in ("inputs", "targets")}
  t0 = time.time()
  compiled = step.lower(abstract, batch).compile()
  mem = compiled.memory_analysis()
  n = sum(int(x.size) for x in jax.tree.leaves(abstract["params"]))
  fpt = training.flops_per_token(model_cfg, t.seq_len)
  gib = 2**30
  lines = [
      f"config        {config_flags.get_config_filename(FLAGS['config'])}",
      f"scheme        {model_cfg.residual} (routing heads"
      f" {model_cfg.heads_per_site}, blocks {model_cfg.num_blocks or 'full'})",
      f"parameters    {n:,} ({n / 1e9:.4f} B)",
      f"mesh          data={data} model={model} on {jax.device_count()}"
      f" {jax.devices()[0].platform} device(s)",
      f"batch         {t.global_batch} x {t.seq_len} tokens,"
      f" grad_accum {t.grad_accum}",
      f"FLOPs/token   {fpt / 1e9:.3f} GFLOP (6N + 6 L H d_h T)",
      f"FLOPs/step    {fpt * t.global_batch * t.seq_len / 1e15:.3f} PFLOP",
      f"compile time  {time.time() - t0:.1f} s",
  ]
  if mem is not None:
    per_dev = (mem.argument_size_in_bytes + mem.output_size_in_bytes
               - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    lines += [
        "XLA memory per device:",
        f"  arguments   {mem.argument_size_in_bytes / gib:8.2f} GiB"
        " (state + batch)",
        f"  outputs     {mem.output_size_in_bytes / gib:8.2f} GiB"
        f" (aliased with donated inputs: {mem.alias_size_in_bytes / gib:.2f})",
        f"  temporaries {mem.temp_size_in_bytes / gib:8.2f} GiB",
        f"  peak (est.) {per_dev / gib:8.2f} GiB",
    ]
  print("\n".join(lines), flush=True)
  return compiled


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS["verbosity"].present:   # Orbax logs every save at INFO
    logging.set_verbosity(logging.WARNING)
  if FLAGS.dry_run and FLAGS.dry_run_devices:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count="
                               f"{FLAGS.dry_run_devices}")
  import jax
  from mhar_jax import distributed
  from mhar_jax import training
  from mhar_jax.checkpoint import (CheckpointError, check_compatible,
                                   check_writable, latest_meta)
  from mhar_jax.config import model_config, validate

  cfg = _CONFIG.value
  try:
    # Configuration errors first: nothing is started or loaded before this.
    model_config(cfg)
    if not FLAGS.dry_run:
      distributed.initialize(coordinator_address=FLAGS.coordinator_address,
                             num_processes=FLAGS.num_processes,
                             process_id=FLAGS.process_id,
                             heartbeat_timeout=FLAGS.heartbeat_timeout)
    model_cfg = validate(cfg, num_devices=jax.device_count(),
                         process_count=jax.process_count())
    workdir = FLAGS.workdir or default_workdir(
        config_flags.get_config_filename(FLAGS["config"]))
    if not FLAGS.dry_run:
      check_writable(workdir)
      data_dir = resolve_data(cfg, model_cfg)
      meta = latest_meta(os.path.join(workdir, "checkpoints"))
      if meta is not None:   # resuming: the checkpoint must be this model
        check_compatible(meta, training.fingerprint(model_cfg))
  except (ValueError, CheckpointError) as e:
    sys.exit(f"mhar_jax.train: {e}")
  if FLAGS.dry_run:
    dry_run(cfg, model_cfg)
    return
  if not FLAGS.workdir:
    say(f"no --workdir given: writing to {os.path.abspath(workdir)}")
  trainer = Trainer(cfg, model_cfg, workdir, data_dir)
  trainer.run()
  say(f"done; checkpoints and TensorBoard events in {os.path.abspath(workdir)}")


if __name__ == "__main__":
  app.run(main)
