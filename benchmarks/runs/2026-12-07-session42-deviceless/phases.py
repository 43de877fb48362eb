"""Trace / lower / compile seconds of one run's train step for an H200
without one; argv: preset scheme cache_dir. From the repository root:
XLA_FLAGS=--xla_disable_hlo_passes=rematerialization XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 \
  python benchmarks/runs/2026-12-07-session42-deviceless/phases.py 1b mhar DIR"""
import os
import sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../.."))
import h200_aot; devs = h200_aot.setup()
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[3])
import throughput
from mhar_jax import parallel, training
from mhar_jax.config import validate
preset, scheme = sys.argv[1], sys.argv[2]
cfg = throughput.load_preset(preset); cfg.model.update(**throughput.SCHEMES[scheme]); cfg.model.routing_impl = "auto"
t = cfg.train; t.grad_accum = 1
model_cfg = validate(cfg, num_devices=1); mesh = parallel.make_mesh(1, 1, devs)
tx = training.make_optimizer(t); gdef = training.graphdef(model_cfg)
state_sh = training.state_shardings_for(model_cfg, tx, mesh); batch_sh = parallel.batch_sharding(mesh)
step = training.make_train_step(gdef, tx, t, state_sh, batch_sh)
abstract = training.abstract_state(model_cfg, tx, state_sh)
spec = {k: jax.ShapeDtypeStruct((t.global_batch, t.seq_len), jnp.int32, sharding=batch_sh) for k in ("inputs", "targets")}
t0 = time.time(); tr = step.trace(abstract, spec); t1 = time.time()
lo = tr.lower(); t2 = time.time()
text = lo.as_text(); t3 = time.time()
c = lo.compile(); t4 = time.time()
print(f"{preset}/{scheme}: trace {t1-t0:.1f}s lower {t2-t1:.1f}s (as_text {t3-t2:.1f}s, {len(text)/1e6:.1f} MB) compile {t4-t3:.1f}s")
