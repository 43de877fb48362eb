"""Writes the unrolled per-source code of mhar_jax/kernels/triton_route.py.

Triton kernels take a fixed number of pointer arguments, so the routing
kernels name ``MAX_SOURCES_PER_LAUNCH`` sources ``s0 .. s15`` and unroll the
loop over them, with the load of source ``k + PF`` issued before source ``k``
is reduced (the prefetch the module docstring describes). This script
regenerates every ``# <gen:NAME> ... # </gen:NAME>`` block of that file::

    python tools/gen_route_steps.py          # rewrite the blocks in place
    python tools/gen_route_steps.py --check  # exit 1 if they are stale

tests/test_triton_route_interp.py runs ``--check``.
"""

from __future__ import annotations

import pathlib
import re
import sys
import textwrap

K = 16          # MAX_SOURCES_PER_LAUNCH
MAX_PF = 4      # prefetch depths 1..4
PATH = (pathlib.Path(__file__).resolve().parent.parent
        / "mhar_jax" / "kernels" / "triton_route.py")


def _names(prefix: str) -> str:
  names = [f"{prefix}{k}" for k in range(K)]
  return "\n".join(", ".join(names[i:i + 8]) + ","
                   for i in range(0, K, 8))


def _load(k: int) -> str:
  return f"x{k}a, x{k}b = _load(s{k}, base, offa, mska, offb, mskb, CB)"


def _load_with_r(k: int) -> str:
  """Source k's tile and, when it is given, its inverse RMS."""
  return _load(k) + f"\nr{k}v = _load_r(r{k}, rrow, rmask, HAS_R)"


def _steps(step, load=_load) -> str:
  """The unrolled loop: loads ``0 .. PF-1`` up front, then per source ``k``
  the load of ``k + PF`` followed by ``step(k)``."""
  out = []
  ind = lambda text, n: textwrap.indent(text, " " * n)  # noqa: E731
  for p in range(MAX_PF):
    out += [f"if PF > {p}:", f"  if NSRC > {p}:", ind(load(p), 4)]
  for k in range(K):
    out.append(f"if NSRC > {k}:")
    for pf in range(1, MAX_PF + 1):
      if k + pf < K:
        out += [f"  if PF == {pf}:", f"    if NSRC > {k + pf}:",
                ind(load(k + pf), 6)]
    out += ["  " + line for line in step(k).splitlines()]
  return "\n".join(out)


def _fwd(k: int) -> str:
  return (f"m, l, acca, accb, r{k}w = _fwd_step(\n"
          f"    x{k}a, x{k}b, r{k}v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,\n"
          f"    HAS_R)\n"
          f"_store_r(r_out, {k}, N, rrow, rmask, r{k}w, WRITE_R)")


def _cpass(k: int) -> str:
  return (f"c = _cpass_step(x{k}a, x{k}b, r{k}v, ta, tb, ga, gb, lse, c, D,\n"
          f"                EPS, PIN, CB, HAS_R)")


def _bwd(k: int) -> str:
  return (f"dta, dtb = _bwd_step(x{k}a, x{k}b, r{k}v, ds{k}, base, offa,\n"
          f"                     mska, offb, mskb, ta, tb, ga, gb, lse, c,\n"
          f"                     dta, dtb, D, EPS, CB, HAS_R)")


BLOCKS = {
    "FWD_SRC_PARAMS": (4, lambda: _names("s") + "\n" + _names("r")),
    "CPASS_SRC_PARAMS": (4, lambda: _names("s") + "\n" + _names("r")),
    "BWD_SRC_PARAMS": (4, lambda: _names("s") + "\n" + _names("r")),
    "BWD_INIT_PARAMS": (4, lambda: _names("i")),
    "BWD_OUT_PARAMS": (4, lambda: _names("ds")),
    "FWD_STEPS": (2, lambda: _steps(_fwd, _load_with_r)),
    "CPASS_STEPS": (2, lambda: _steps(_cpass, _load_with_r)),
    "BWD_STEPS": (4, lambda: _steps(_bwd, _load_with_r)),
}


def render(text: str) -> str:
  """``text`` with every generated block rewritten."""
  for name, (indent, body) in BLOCKS.items():
    pat = re.compile(rf"(?P<head>^[ ]*# <gen:{name}>\n).*?"
                     rf"(?P<tail>^[ ]*# </gen:{name}>\n)", re.S | re.M)
    if len(pat.findall(text)) != 1:
      raise SystemExit(f"{PATH}: expected one '# <gen:{name}>' block")
    new = textwrap.indent(body(), " " * indent) + "\n"
    text = pat.sub(lambda m: m["head"] + new + m["tail"], text)
  return text


def main(argv) -> int:
  text = PATH.read_text()
  new = render(text)
  if "--check" in argv:
    if new != text:
      print(f"{PATH} is stale: run python tools/gen_route_steps.py")
      return 1
    return 0
  PATH.write_text(new)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
