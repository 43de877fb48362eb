"""Where a trained routed model looks in depth, and how much its heads differ.

``python -m mhar_jax.analyze --workdir DIR [--step N] [--split val]
[--batches 4] [--batch 8] [--data_dir D] [--out DIR/analysis]``

Loads the parameters of a trainer checkpoint (read-only: nothing under
``DIR/checkpoints`` is created, cleaned up or renamed, so a run that is still
training can be analysed), runs the model with ``return_routing=True`` on
validation windows and writes to ``--out``:

* ``depth_attention.png``: one heatmap per head, site j (rows) x source i
  (columns) of the mean routing weight over tokens (blank where site j has
  fewer sources), one colour scale;
* ``head_divergence.png``: per site, the mean pairwise Jensen-Shannon
  divergence between heads, token by token, and the JS divergence of the heads'
  token-averaged maps;
* ``analysis.json``: every number (maps, JS, entropies, step, scheme, tokens);

and the two figures (``analysis/...``) and the token-level JS per site
(``analysis/js_site_XXX``) to ``DIR/tensorboard``. Divergences and entropies
are in nats. Schemes attnres, mhar and delta only.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import struct
import sys

import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-12


class AnalysisError(RuntimeError):
  """A run that cannot be analysed (no checkpoint, unrouted scheme, ...)."""


# -- the numbers ------------------------------------------------------------------

def _by_token(weights: jax.Array) -> jax.Array:
  """``[S, ..., H] -> [S, N, H]`` float32, the token axes flattened."""
  w = jnp.asarray(weights, jnp.float32)
  return w.reshape(w.shape[0], -1, w.shape[-1])


def js_divergence(p: jax.Array, q: jax.Array) -> jax.Array:
  """Jensen-Shannon divergence (nats) over axis 0 of ``[S, ...]`` distributions:
  ``0.5 KL(p||m) + 0.5 KL(q||m)``, ``m = (p + q) / 2``, returned as ``[...]``.
  Zero entries contribute zero (logs of values clipped to ``EPS``)."""
  m = 0.5 * (p + q)
  log_m = jnp.log(jnp.clip(m, EPS, 1.0))
  kl_p = jnp.sum(p * (jnp.log(jnp.clip(p, EPS, 1.0)) - log_m), axis=0)
  kl_q = jnp.sum(q * (jnp.log(jnp.clip(q, EPS, 1.0)) - log_m), axis=0)
  return jnp.maximum(0.5 * (kl_p + kl_q), 0.0)


def pairwise_js(weights: jax.Array) -> jax.Array:
  """Mean JS divergence between heads of ``[S, ..., H]`` weights (one site),
  over the ``H (H - 1) / 2`` head pairs and the tokens ``...``; a scalar (0 for
  H = 1). ``[S, H]`` (token-averaged maps) gives the JS of the mean maps."""
  w = _by_token(weights)
  heads = w.shape[-1]
  if heads == 1:
    return jnp.zeros((), jnp.float32)
  total = jnp.zeros((), jnp.float32)
  for h in range(heads - 1):   # head h against heads h+1..H-1: [S, N, H-h-1]
    total += jnp.sum(jnp.mean(js_divergence(w[:, :, h:h + 1], w[:, :, h + 1:]),
                              axis=0))
  return total / (heads * (heads - 1) // 2)


def head_entropy(weights: jax.Array) -> jax.Array:
  """Mean entropy (nats) over tokens of each head, ``[S, ..., H] -> [H]``."""
  w = _by_token(weights)
  return jnp.mean(-jnp.sum(w * jnp.log(jnp.clip(w, EPS, 1.0)), axis=0), axis=0)


def routing_summary(routing: list[jax.Array]) -> dict:
  """Per-site statistics of a forward's routing weights (a list over sites j of
  ``[S_j, B, T, H]``): ``maps`` (list of ``[S_j, H]``, mean weight over B and
  T), ``js`` (``[sites]``, :func:`pairwise_js`) and ``entropy`` (``[sites, H]``,
  :func:`head_entropy`). Jittable."""
  return {"maps": [jnp.mean(_by_token(w), axis=1) for w in routing],
          "js": jnp.stack([pairwise_js(w) for w in routing]),
          "entropy": jnp.stack([head_entropy(w) for w in routing])}


# -- loading ----------------------------------------------------------------------

def _finalised_steps(ckpt_dir: str) -> list[int]:
  """Finished steps under ``ckpt_dir``, newest first."""
  from mhar_jax.checkpoint import step_problem
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted((int(n) for n in os.listdir(ckpt_dir) if n.isdigit()
                 and step_problem(os.path.join(ckpt_dir, n)) is None),
                reverse=True)


def load_run(workdir: str, step: int | None = None):
  """``(cfg, model_cfg, graphdef, params, meta)`` of checkpoint ``step`` (the
  newest readable one when None) of a trainer workdir, on one device."""
  import ml_collections

  from mhar_jax import parallel, training
  from mhar_jax.checkpoint import check_compatible, read_params
  from mhar_jax.config import model_config
  from mhar_jax.layers import ROUTED

  ckpt_dir = os.path.join(workdir, "checkpoints")
  steps = _finalised_steps(ckpt_dir)
  if step is not None:
    if step not in steps:
      raise AnalysisError(f"--step={step}: no finished checkpoint step {step}"
                          f" in {ckpt_dir} (have {sorted(steps)}).")
    steps = [step]
  if not steps:
    raise AnalysisError(f"--workdir={workdir!r}: no checkpoint in {ckpt_dir}.")
  problems = []
  for s in steps:
    d = os.path.join(ckpt_dir, str(s))
    try:
      with open(os.path.join(d, "meta", "meta.json")) as f:
        meta = json.load(f)
    except (OSError, ValueError) as e:
      problems.append(f"step {s}: unreadable meta ({e})")
      continue
    cfg = ml_collections.ConfigDict(meta["config"])
    model_cfg = model_config(cfg)
    if model_cfg.residual not in ROUTED:
      raise AnalysisError(
          f"model.residual={model_cfg.residual!r} has no depth routing to"
          f" analyse; analyze needs a routed run (one of {ROUTED}).")
    check_compatible(meta, training.fingerprint(model_cfg))
    mesh = parallel.make_mesh(1, 1, jax.devices()[:1])
    tx = training.make_optimizer(cfg.train)
    shardings = training.state_shardings_for(model_cfg, tx, mesh)
    abstract = training.abstract_state(model_cfg, tx, shardings)
    try:
      params = read_params(d, abstract["params"])
    except Exception as e:  # noqa: BLE001 - a damaged step: try an older one
      problems.append(f"step {s}: {type(e).__name__}: {str(e)[:200]}")
      continue
    if problems:
      print("mhar_jax.analyze: skipped unreadable " + "; ".join(problems),
            file=sys.stderr)
    meta.setdefault("step", s)
    return cfg, model_cfg, training.graphdef(model_cfg), params, meta
  raise AnalysisError(f"no readable checkpoint in {ckpt_dir}: "
                      + "; ".join(problems))


def make_summary_fn(gdef, params_sh, batch_sh):
  """Jitted ``(params, inputs [B, T]) ->`` :func:`routing_summary` of one
  batch."""
  from flax import nnx
  from flax.core import spmd as core_spmd

  from mhar_jax.layers import DEFAULT_RULES

  def summary(params, inputs):
    with core_spmd.logical_axis_rules(DEFAULT_RULES):
      _, routing = nnx.merge(gdef, params)(inputs, return_routing=True)
      return routing_summary(routing)
  return jax.jit(summary, in_shardings=(params_sh, batch_sh))


# -- figures ----------------------------------------------------------------------

def _png(fig) -> tuple[bytes, int, int]:
  """``(png bytes, height, width)`` of a matplotlib Figure (Agg, no pyplot)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  FigureCanvasAgg(fig)
  buf = io.BytesIO()
  fig.savefig(buf, format="png")
  png = buf.getvalue()
  width, height = struct.unpack(">II", png[16:24])   # the IHDR chunk
  return png, height, width


def depth_attention_figure(maps: list[np.ndarray], title: str,
                           source_label: str) -> tuple[bytes, int, int]:
  """Heatmaps site x source of ``maps`` (list over sites of ``[S_j, H]``), one
  panel per head, NaN (blank) where a site has fewer sources."""
  import matplotlib
  from matplotlib.figure import Figure
  from matplotlib.ticker import MaxNLocator
  heads, s_max = maps[0].shape[1], max(m.shape[0] for m in maps)
  grid = np.full((heads, len(maps), s_max), np.nan)
  for j, m in enumerate(maps):
    grid[:, j, :m.shape[0]] = np.asarray(m).T
  cols = min(heads, 4)
  rows = math.ceil(heads / cols)
  fig = Figure(figsize=(3.4 * cols + 1.2, 3.2 * rows + 0.6), dpi=100,
               layout="constrained")
  axes = fig.subplots(rows, cols, squeeze=False)
  cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
  for h, ax in enumerate(axes.flat):
    if h >= heads:
      ax.set_visible(False)
      continue
    im = ax.imshow(grid[h], aspect="auto", interpolation="nearest", cmap=cmap,
                   vmin=0.0, vmax=float(np.nanmax(grid)))
    ax.set_title(f"head {h}")
    ax.set_xlabel(source_label)
    ax.set_ylabel("site j")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
  fig.colorbar(im, ax=axes, label="mean routing weight")
  fig.suptitle(title)
  return _png(fig)


def head_divergence_figure(js: np.ndarray, js_of_means: np.ndarray,
                           title: str) -> tuple[bytes, int, int]:
  """Per-site token-level pairwise JS and JS of the mean maps (nats)."""
  from matplotlib.figure import Figure
  from matplotlib.ticker import MaxNLocator
  fig = Figure(figsize=(7, 3.8), dpi=100, layout="constrained")
  ax = fig.subplots()
  sites = np.arange(len(js))
  ax.plot(sites, js, "o-", label="mean pairwise JS, per token")
  ax.plot(sites, js_of_means, "s--", label="JS of the mean maps")
  ax.set_xlabel("site j")
  ax.set_ylabel("JS between heads (nats, max ln 2)")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_ylim(bottom=0)
  ax.legend()
  ax.set_title(title)
  return _png(fig)


# -- the command ------------------------------------------------------------------

def analyze(workdir: str, *, step: int | None = None, split: str = "val",
            batches: int = 4, batch: int = 8, data_dir: str | None = None,
            seq_len: int | None = None, out: str | None = None) -> dict:
  """Runs the analysis (module docstring), writes its files; returns the dict
  written to ``analysis.json``."""
  from mhar_jax import parallel
  from mhar_jax.data import make_eval_batches, resolve_data_dir
  from mhar_jax.summary import SummaryWriter

  cfg, model_cfg, gdef, params, meta = load_run(workdir, step)
  step = int(meta["step"])
  data_dir = resolve_data_dir(data_dir or cfg.data.data_dir)
  seq_len = seq_len or cfg.train.seq_len
  mesh = parallel.make_mesh(1, 1, jax.devices()[:1])
  batch_sh = parallel.batch_sharding(mesh)
  params_sh = jax.tree.map(lambda x: x.sharding, params)
  summary = make_summary_fn(gdef, params_sh, batch_sh)
  parts = [jax.device_get(summary(params,
                                  jax.device_put(b["inputs"], batch_sh)))
           for b in make_eval_batches(data_dir, split, seq_len=seq_len,
                                      batch=batch, max_batches=batches)]
  # Every batch has batch x seq_len tokens: the mean of means is the mean.
  maps = [np.mean([p["maps"][j] for p in parts], axis=0)
          for j in range(len(parts[0]["maps"]))]
  js = np.mean([p["js"] for p in parts], axis=0)
  entropy = np.mean([p["entropy"] for p in parts], axis=0)
  js_of_means = np.asarray(jax.jit(
      lambda ms: jnp.stack([pairwise_js(m) for m in ms]))(maps))
  heads = model_cfg.heads_per_site
  result = {
      "workdir": os.path.abspath(workdir), "step": step,
      "scheme": model_cfg.residual, "heads": heads,
      "num_layers": model_cfg.num_layers, "num_blocks": model_cfg.num_blocks,
      "num_sites": len(maps), "sources": [int(m.shape[0]) for m in maps],
      "split": split, "data_dir": data_dir, "batches": len(parts),
      "batch": batch, "seq_len": seq_len,
      "tokens": len(parts) * batch * seq_len,
      "maps": [m.tolist() for m in maps],   # site j: [S_j][H], sum 1 over S_j
      "js": js.tolist(), "js_of_means": js_of_means.tolist(),
      "entropy": entropy.tolist(),          # [sites][H]
      "entropy_uniform": [math.log(m.shape[0]) for m in maps],
  }

  out = out or os.path.join(workdir, "analysis")
  os.makedirs(out, exist_ok=True)
  name = f"{model_cfg.residual}, {heads} head{'s' * (heads > 1)}" + (
      f", {model_cfg.num_blocks} blocks" if model_cfg.num_blocks else "")
  source_label = ("source (0 = null, then block deltas)"
                  if model_cfg.residual == "delta" else
                  "source (s_0 = embedding, then block sums)"
                  if model_cfg.num_blocks else "source (s_0 = embedding)")
  figures = {
      "depth_attention": depth_attention_figure(
          maps, f"Depth attention, {name}, step {step}", source_label),
      "head_divergence": head_divergence_figure(
          js, js_of_means, f"Head divergence, {name}, step {step}"),
  }
  for fig_name, (png, _, _) in figures.items():
    with open(os.path.join(out, f"{fig_name}.png"), "wb") as f:
      f.write(png)
  with open(os.path.join(out, "analysis.json"), "w") as f:
    json.dump(result, f, indent=1)
  writer = SummaryWriter(os.path.join(workdir, "tensorboard"))
  try:
    for fig_name, (png, height, width) in figures.items():
      writer.image(f"analysis/{fig_name}", png, height=height, width=width,
                   step=step)
    writer.scalars({f"analysis/js_site_{j:03d}": v for j, v in enumerate(js)},
                   step)
  finally:
    writer.close()

  print(f"{name}, step {step}: {result['tokens']:,} tokens of {split!r}")
  print(f"{'site':>4} {'sources':>7} {'entropy':>8} {'ln S':>6} {'JS':>7}"
        f" {'JS means':>8}")
  for j, m in enumerate(maps):
    print(f"{j:4d} {m.shape[0]:7d} {entropy[j].mean():8.4f}"
          f" {math.log(m.shape[0]):6.3f} {js[j]:7.4f} {js_of_means[j]:8.4f}")
  print(f"wrote {', '.join(f'{n}.png' for n in figures)} and analysis.json to"
        f" {out}; images and analysis/js_site_* to"
        f" {os.path.join(workdir, 'tensorboard')}")
  return result


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      prog="python -m mhar_jax.analyze",
      description="Depth-attention maps and head divergence of a routed run"
      " (attnres, mhar, delta) from a trainer workdir.")
  p.add_argument("--workdir", required=True, help="trainer workdir")
  p.add_argument("--step", type=int, default=None,
                 help="checkpoint step (default: the newest)")
  p.add_argument("--split", default="val", help="data split to run on")
  p.add_argument("--batches", type=int, default=4)
  p.add_argument("--batch", type=int, default=8, help="windows per batch")
  p.add_argument("--seq_len", type=int, default=None,
                 help="window length (default: the run's train.seq_len)")
  p.add_argument("--data_dir", default=None,
                 help="data directory (default: the run's data.data_dir)")
  p.add_argument("--out", default=None, help="default: WORKDIR/analysis")
  a = p.parse_args(argv)
  try:
    analyze(a.workdir, step=a.step, split=a.split, batches=a.batches,
            batch=a.batch, data_dir=a.data_dir, seq_len=a.seq_len, out=a.out)
  except (AnalysisError, ValueError, FileNotFoundError) as e:
    print(f"mhar_jax.analyze: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
