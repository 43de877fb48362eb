"""A Qwen3-style decoder whose residual scheme is a config value.

Schemes (``TransformerConfig.residual``):

* ``prenorm``  — ``x_{j+1} = x_j + f_j(x_j)``, the baseline;
* ``hyper``    — static Hyper-Connections with ``hyper_streams`` streams;
* ``attnres``  — each sublayer reads a softmax mixture of all earlier
  sources (AttnRes = MHAR with one head);
* ``mhar``     — the same with ``routing_heads`` heads;
* ``delta``    — the ordinary stream plus a gated, routed correction over block
  deltas (identity at initialisation; for converting trained models).

Every sublayer ``f_j`` (attention or SwiGLU) applies its own RMSNorm to its
input. For routed schemes the sources are ``s_0 = embedding`` and the raw
sublayer outputs ``s_{j+1}``; with ``num_blocks`` set, the outputs of each block
of consecutive sublayers are summed (Block AttnRes / Block MHAR) and a site
reads ``[s_0, finished block sums..., the current block's partial sum]``. One
sublayer per block (the default, ``num_blocks=0``) is the full method. A final
routing site precedes the final norm. The full method runs as one
:func:`mhar_jax.kernels.stack.routed_stack` over all sublayers, whose backward
works source by source (``routing_backward="source"``, what ``"auto"`` picks);
Block AttnRes / MHAR run as the same op over their block sums. ``"site"``
differentiates site by site instead (the same function and gradients). The
LM head is the tied embedding, or a separate ``lm_head [V, D]`` with
``tie_embeddings=False``; ``qk_norm=False`` drops the per-head QK-RMSNorm
(Llama-style attention, for converted models).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mhar_jax import kernels
from mhar_jax.kernels.stack import block_ends
from mhar_jax.layers.basic import (Attention, RMSNorm, SwiGLU, normal, param,
                                   project_logits)
from mhar_jax.layers.router import DepthRouter, HyperConnection, block_boundaries
from mhar_jax.layers.sharding import BTD, constrain

RESIDUALS = ("prenorm", "hyper", "attnres", "mhar", "delta")
ROUTED = ("attnres", "mhar", "delta")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}
ATTENTION_IMPLS = (None, "xla", "cudnn")
RECOMPUTE_SOURCES = ("none", "attention", "all")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Architecture of :class:`Transformer`. Invalid values raise ValueError
  naming the key (as ``model.<key>``) and the value."""

  vocab_size: int = 151_936
  d_model: int = 512
  num_layers: int = 12
  num_heads: int = 8
  num_kv_heads: int = 4
  head_dim: int = 64
  ffn_dim: int = 1536
  max_seq_len: int = 2048
  residual: str = "prenorm"
  routing_heads: int = 8     # mhar / delta; attnres always uses 1
  num_blocks: int = 0        # 0: one block per sublayer (the full method)
  hyper_streams: int = 4
  rope_theta: float = 1e4
  norm_eps: float = 1e-6
  qk_norm: bool = True       # per-head QK-RMSNorm (Qwen3); False: Llama style
  tie_embeddings: bool = True  # False: a separate lm_head [V, D]
  init_std: float = 0.02
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  attention_impl: str | None = None
  routing_impl: str = "auto"
  routing_backward: str = "auto"   # "auto" | "site" | "source" (attnres / mhar)
  # Source-major stacks: route sites two-phase in groups (routed_stack's
  # site_group: 0 each site alone; G >= 2 groups of G sites, by block when
  # blocked; None: groups of 16 where they run on tensor cores, i.e. Triton
  # and the full method, else 0). Same function up to rounding; an
  # implementation choice.
  routing_site_group: int | None = None
  # Source-major stacks: recompute the routing sources (full method) or
  # block and partial sums (blocks) from these sublayers' output projection's
  # input in the backward instead of keeping them ("none" | "attention" |
  # "all"): a copy of their outputs less at the memory peak for one more
  # output projection each.
  recompute_sources: str = "none"
  # Source-major stacks: the share of the routing sites, lowest first, that
  # keep no output (the input of the sublayer's RMSNorm) but recompute it in
  # the backward from the kept sources, one causal pass a group of sites: a
  # [B, T, D] array a sublayer less at the memory peak for one more routing
  # pass. 0 (False): none; 1 (True): all; 0.5: the lower half of the sites
  # (the cheapest: they read the fewest sources; the paper presets' value).
  # Not with recompute_sources (it needs the sources kept); no effect on
  # prenorm / hyper, which have no routing sites.
  recompute_site_outputs: float = 0.0
  remat: bool = False

  def __post_init__(self):
    def bad(key, why):
      raise ValueError(f"model.{key}={getattr(self, key)!r}: {why}")

    for key in ("vocab_size", "d_model", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "ffn_dim", "max_seq_len",
                "hyper_streams"):
      if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
        bad(key, "must be a positive integer.")
    for key in ("qk_norm", "tie_embeddings"):
      if not isinstance(getattr(self, key), bool):
        bad(key, "must be True or False.")
    if self.residual not in RESIDUALS:
      bad("residual", f"unknown residual scheme; choose one of {RESIDUALS}.")
    if self.num_heads % self.num_kv_heads:
      bad("num_kv_heads", f"must divide model.num_heads={self.num_heads}.")
    if self.head_dim % 2:
      bad("head_dim", "must be even (RoPE rotates channel pairs).")
    if self.residual in ("mhar", "delta") and (
        self.routing_heads < 1 or self.d_model % self.routing_heads):
      bad("routing_heads",
          f"must be >= 1 and divide model.d_model={self.d_model}.")
    if self.num_blocks and not 1 <= self.num_blocks <= 2 * self.num_layers:
      bad("num_blocks", "must be 0 (full method) or between 1 and the number"
          f" of sublayers, 2 * model.num_layers = {2 * self.num_layers}.")
    if self.num_blocks < 0:
      bad("num_blocks", "must be >= 0.")
    for key in ("dtype", "param_dtype"):
      if getattr(self, key) not in DTYPES:
        bad(key, f"choose one of {tuple(DTYPES)}.")
    if self.attention_impl not in ATTENTION_IMPLS:
      bad("attention_impl", f"choose one of {ATTENTION_IMPLS}.")
    if self.routing_impl not in kernels.IMPLS:
      bad("routing_impl", f"choose one of {kernels.IMPLS}.")
    if self.routing_backward not in ("auto", "site", "source"):
      bad("routing_backward", "choose 'auto', 'site' or 'source'.")
    if self.routing_backward == "source" and self.residual not in (
        "attnres", "mhar"):
      bad("routing_backward", "'source' is for AttnRes / MHAR (full or"
          f" block); got model.residual={self.residual!r}.")
    if self.routing_site_group is not None and (
        not isinstance(self.routing_site_group, int)
        or self.routing_site_group < 0):
      bad("routing_site_group", "must be None (automatic) or an integer >= 0"
          " (0: every site on its own).")
    if self.routing_site_group and not self.source_major_backward:
      bad("routing_site_group", "groups sites of the source-major stack"
          " (AttnRes / MHAR with routing_backward 'auto' or 'source');"
          f" got model.residual={self.residual!r},"
          f" routing_backward={self.routing_backward!r}.")

    if self.recompute_sources not in RECOMPUTE_SOURCES:
      bad("recompute_sources", f"choose one of {RECOMPUTE_SOURCES}.")
    if self.recompute_sources != "none" and not self.source_major_backward:
      bad("recompute_sources", "recomputes the sources of the source-major"
          " stack (AttnRes / MHAR, full or blocks, routing_backward 'auto' or"
          f" 'source'); got model.residual={self.residual!r},"
          f" routing_backward={self.routing_backward!r}. Set it to 'none'.")
    if (not isinstance(self.recompute_site_outputs, (int, float))
        or not 0 <= self.recompute_site_outputs <= 1):
      bad("recompute_site_outputs", "must be a share of the sites between 0"
          " and 1 (False / True: none / all).")
    # prenorm / hyper have no routing sites: a share of none is no share.
    if (self.recompute_site_outputs and self.residual in ROUTED
        and not self.source_major_backward):
      bad("recompute_site_outputs", "recomputes the sites of the source-major"
          " stack (AttnRes / MHAR, full or blocks, routing_backward 'auto' or"
          f" 'source'); got model.residual={self.residual!r},"
          f" routing_backward={self.routing_backward!r}. Set it to 0.")
    if self.recompute_site_outputs and self.recompute_sources != "none":
      bad("recompute_site_outputs", "recomputes the sites' outputs from the"
          " kept sources, which model.recompute_sources="
          f"{self.recompute_sources!r} does not keep: set"
          " model.recompute_site_outputs=0 or model.recompute_sources='none'.")

  @property
  def source_major_backward(self) -> bool:
    """Whether the stack routes as one ``routed_stack`` (source-major
    backward): AttnRes / MHAR, full or block, unless ``routing_backward`` is
    ``"site"`` (measured faster on the H200 at every preset, full and
    block; benchmarks/RESULTS.md)."""
    return (self.residual in ("attnres", "mhar")
            and self.routing_backward != "site")

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "TransformerConfig":
    """Builds a config from a dict; an unknown key raises ValueError."""
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in d:
      if key not in fields:
        raise ValueError(f"model.{key}: unknown key; the model config keys are"
                         f" {sorted(fields)}.")
    return cls(**d)

  @property
  def heads_per_site(self) -> int:
    """Routing heads H used at every site (1 for AttnRes)."""
    return 1 if self.residual == "attnres" else self.routing_heads

  @property
  def num_sublayers(self) -> int:
    return 2 * self.num_layers

  @property
  def blocks(self) -> list[int]:
    """Block index of each sublayer (``delta`` defaults to 8 blocks)."""
    n = self.num_blocks or (min(8, self.num_sublayers)
                            if self.residual == "delta" else self.num_sublayers)
    return block_boundaries(self.num_sublayers, n)

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]


class AttentionSublayer(nnx.Module):
  """``x -> Attention(RMSNorm(x))``, ``[B, T, D] -> [B, T, D]``."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    pd = DTYPES[cfg.param_dtype]
    self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pd,
                        rngs=rngs)
    self.attn = Attention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads,
                          cfg.head_dim, rope_theta=cfg.rope_theta,
                          eps=cfg.norm_eps, init_std=cfg.init_std,
                          implementation=cfg.attention_impl,
                          dtype=cfg.compute_dtype, param_dtype=pd,
                          qk_norm=cfg.qk_norm, rngs=rngs)

  def __call__(self, x, positions):
    return self.project(self.body(x, positions))

  def body(self, x, positions, normed=False):
    """Everything before the output projection: ``[B, T, H, K]``
    (``normed``: ``x`` is ``self.norm``'s output already)."""
    return self.attn.heads(x if normed else self.norm(x), positions)

  def project(self, u):
    return self.attn.project(u)


class MLPSublayer(nnx.Module):
  """``x -> SwiGLU(RMSNorm(x))``, ``[B, T, D] -> [B, T, D]``."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    pd = DTYPES[cfg.param_dtype]
    self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pd,
                        rngs=rngs)
    self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim, init_std=cfg.init_std,
                      dtype=cfg.compute_dtype, param_dtype=pd, rngs=rngs)

  def __call__(self, x, positions):
    return self.project(self.body(x, positions))

  def body(self, x, positions, normed=False):
    """Everything before the down projection: ``[B, T, F]`` (``normed``:
    ``x`` is ``self.norm``'s output already)."""
    del positions
    return self.mlp.hidden(x if normed else self.norm(x))

  def project(self, u):
    return self.mlp.project(u)


class DecoderLayer(nnx.Module):
  """One transformer block: an attention sublayer and an MLP sublayer."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    self.attention = AttentionSublayer(cfg, rngs)
    self.mlp = MLPSublayer(cfg, rngs)


def _call_sublayer(sublayer, x, positions):
  return sublayer(x, positions)


def _apply_sublayer(j, state, x, positions, *, graphdefs, split=None,
                    normed=False):
  """Sublayer ``j`` as a pure function of its state (for ``routed_stack``);
  where ``split[j]``, only its body (the input of its output projection);
  ``normed``: without its input norm (``x`` is that norm's output)."""
  sublayer = nnx.merge(graphdefs[j], state)
  u = sublayer.body(x, positions, normed=normed)
  return u if split is not None and split[j] else sublayer.project(u)


def _norm_scale(j, state, *, graphdefs):
  """Sublayer ``j``'s input-norm gain ``[D]`` as a pure function of its
  state."""
  return nnx.merge(graphdefs[j], state).norm.scale[...]


def _project_sublayer(j, state, u, *, graphdefs, split):
  """Sublayer ``j``'s output projection where ``split[j]``, else ``u``."""
  return nnx.merge(graphdefs[j], state).project(u) if split[j] else u


class Transformer(nnx.Module):
  """Decoder-only LM: ``tokens [B, T] int -> logits [B, T, vocab] float32``."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = DTYPES[cfg.param_dtype]
    self.embedding = param(rngs, normal(cfg.init_std),
                           (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                           pd)
    self.layers = nnx.List([DecoderLayer(cfg, rngs)
                            for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pd,
                              rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head = param(rngs, normal(cfg.init_std),
                           (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                           pd)
    n_sites = cfg.num_sublayers + 1
    if cfg.residual in ROUTED:
      self.routers = nnx.List([
          DepthRouter(cfg.d_model, cfg.heads_per_site, eps=cfg.norm_eps,
                      impl=cfg.routing_impl, param_dtype=pd, rngs=rngs)
          for _ in range(n_sites)])
    if cfg.residual == "delta":
      self.null_source = param(rngs, nnx.initializers.zeros, (cfg.d_model,),
                               ("norm",), pd)
      self.gates = nnx.List([
          param(rngs, nnx.initializers.zeros, (cfg.d_model,), ("norm",), pd)
          for _ in range(n_sites)])
    if cfg.residual == "hyper":
      self.hyper = nnx.List([
          HyperConnection(cfg.hyper_streams, j, param_dtype=pd)
          for j in range(cfg.num_sublayers)])

  def sublayers(self) -> list[nnx.Module]:
    """The 2L sublayers in order: attention, MLP, attention, MLP, ..."""
    return [s for layer in self.layers for s in (layer.attention, layer.mlp)]

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
               return_routing: bool = False):
    """Logits ``[B, T, V]`` (float32); with ``return_routing`` also the list of
    per-site routing weights ``[S_j, B, T, H]`` (routed schemes only)."""
    out = self.hidden_states(tokens, positions, return_routing=return_routing)
    x, routing = out if return_routing else (out, None)
    logits = project_logits(x, self.head())
    logits = constrain(logits, ("activation_batch", "activation_length",
                                "activation_vocab"))
    return (logits, routing) if return_routing else logits

  def head(self) -> jax.Array:
    """The LM head ``[V, D]`` in the compute dtype (the tied embedding, or
    ``lm_head``); logits are ``hidden_states @ headᵀ``."""
    w = self.embedding if self.cfg.tie_embeddings else self.lm_head
    return w[...].astype(self.cfg.compute_dtype)

  def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None,
                    *, return_routing: bool = False):
    """The LM head's input ``[B, T, D]`` (after the final norm, compute dtype);
    with ``return_routing`` also the routing weights (see ``__call__``)."""
    cfg = self.cfg
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    emb = self.embedding[...].astype(cfg.compute_dtype)
    h = constrain(jnp.take(emb, tokens, axis=0), BTD)
    call = (nnx.remat(_call_sublayer) if cfg.remat else _call_sublayer)
    routing: list[jax.Array] = []
    subs = self.sublayers()

    if cfg.residual == "prenorm":
      x = h
      for f in subs:
        x = x + call(f, x, positions)
    elif cfg.residual == "hyper":
      streams = jnp.broadcast_to(h[:, :, None, :],
                                 (b, t, cfg.hyper_streams, cfg.d_model))
      for f, hc in zip(subs, self.hyper):
        streams = hc.write(streams, call(f, hc.read(streams), positions))
      x = jnp.sum(streams, axis=2)
    elif cfg.residual == "delta":
      x = self._delta(h, subs, call, positions, routing, return_routing)
    elif cfg.source_major_backward and not return_routing:
      x = self._stacked(h, subs, positions)
    else:
      x = self._routed(h, subs, call, positions, routing, return_routing)

    x = constrain(self.final_norm(x).astype(cfg.compute_dtype), BTD)
    return (x, routing) if return_routing else x

  def _routed(self, h, subs, call, positions, routing, record):
    """AttnRes / MHAR, full or block: route before every sublayer and at the end."""
    ends = block_ends(self.cfg.blocks)
    done = [h]          # s_0 and the finished block sums
    partial = None      # sum of the current block's outputs so far
    for j, f in enumerate(subs):
      sources = done if partial is None else done + [partial]
      if record:
        routing.append(self.routers[j].weights(sources))
      y = call(f, self.routers[j](sources), positions)
      partial = y if partial is None else partial + y
      if ends[j]:
        done.append(partial)
        partial = None
    if record:
      routing.append(self.routers[-1].weights(done))
    return self.routers[-1](done)

  def _stacked(self, h, subs, positions):
    """AttnRes / MHAR (full or block) as one ``routed_stack`` (source-major
    backward)."""
    from mhar_jax.kernels.stack import (SublayerRMSNorm, routed_stack,
                                        takes_norm_kernel)
    graphdefs, states = zip(*(nnx.split(f) for f in subs))
    recompute = self.cfg.recompute_sources
    split = project = None
    if recompute != "none":
      split = tuple(recompute == "all" or isinstance(f, AttentionSublayer)
                    for f in subs)
      project = functools.partial(_project_sublayer,
                                  graphdefs=tuple(graphdefs), split=split)
    # The stack takes the sublayers' input norms when it recomputes the
    # outputs of the lowest sites (rounded half up: 0.5 of 9 sublayers is
    # 5) or takes the norms' gradients by a kernel; not with recomputed
    # sources.
    norm = below = None
    if project is None:
      below = int(self.cfg.recompute_site_outputs * len(subs) + 0.5)
      if below or takes_norm_kernel(self.cfg.routing_impl):
        norm = SublayerRMSNorm(
            functools.partial(_norm_scale, graphdefs=tuple(graphdefs)),
            self.cfg.norm_eps)
    apply = functools.partial(_apply_sublayer, graphdefs=tuple(graphdefs),
                              split=split, normed=norm is not None)
    if self.cfg.remat:
      apply = jax.checkpoint(apply, static_argnums=(0,))
    queries = jnp.stack([r.query[...] for r in self.routers])
    gains = jnp.stack([r.norm_scale[...] for r in self.routers])
    return routed_stack(h, states, apply, queries, gains, positions,
                        num_heads=self.cfg.heads_per_site,
                        eps=self.cfg.norm_eps, impl=self.cfg.routing_impl,
                        blocks=self.cfg.blocks,
                        site_group=self.cfg.routing_site_group,
                        project=project, norm=norm,
                        recompute_below=below if norm else None)

  def _delta(self, h, subs, call, positions, routing, record):
    """The delta form: the ordinary stream plus ``gate * route([null, deltas])``."""
    ends = block_ends(self.cfg.blocks)
    null = jnp.broadcast_to(self.null_source[...].astype(h.dtype), h.shape)
    deltas = [null]
    x, block_start = h, h

    def corrected(j, x):
      if record:
        routing.append(self.routers[j].weights(deltas))
      gate = self.gates[j][...].astype(jnp.float32)
      return (x.astype(jnp.float32)
              + gate * self.routers[j](deltas).astype(jnp.float32)
              ).astype(x.dtype)

    for j, f in enumerate(subs):
      x = x + call(f, corrected(j, x), positions)
      if ends[j]:
        deltas.append(x - block_start)
        block_start = x
    return corrected(len(subs), x)


def count_params(model: nnx.Module) -> int:
  """Number of scalar parameters (``nnx.Param`` leaves) in ``model``."""
  state = nnx.state(model, nnx.Param)
  return sum(int(x.size) for x in jax.tree.leaves(state))
