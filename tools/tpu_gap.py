#!/usr/bin/env python3
"""Why smartvjp's swapped flash attention trails ``optimize_remat=True`` on a
TPU (``design/upstream/tpu_figure.py``'s cells), and why XLA compiles the
swapped megablox step into a larger program: step times, a profile per cell,
the compiled programs, and cells that test each suspected cause.

Flash attention cells (``benchmarks/tpu_attention.py``'s model and sizes,
flags off; ``--policies``, by default ``nothing_saveable``):

* ``False``, ``True``, ``smartvjp``: the figure's three;
* ``smartvjp_unjitted``: the swapped module's ``flash_attention.__wrapped__``
  (no ``func.call`` boundary, as the ``True`` cell calls the shipped one);
* ``True_cost0``: ``True`` with the forward kernel's Pallas cost estimate
  given 0 flops and 0 transcendentals (what the swapped copy's
  ``_fwd_cost_estimate`` computes: ``pl.estimate_cost(mha_reference)``
  reads no cost rule for a smartvjp primitive);
* ``smartvjp_costrule``: the swapped copy traced after a Pallas cost rule is
  registered for smartvjp's primitives (the fix; a no-op where the checkout's
  smartvjp registers one already, which the JSON records).

Per cell: the forward kernels' ``cost_estimate`` read from the lowered
program, the compiled program's size (instructions by opcode, computations,
text length), bitwise equality with ``False``, step time (interleaved
rounds, median/min/max) and a ``jax.profiler`` trace read with
``ProfileData`` (``benchmarks/accel_profile.py``'s reader): device time by op
class, per Pallas kernel, the top ops, and the difference from ``True``.

Megablox (``tools/megablox_tpu.py``'s step): per side, the compiled
program's instructions per computation kind (entry, while bodies, ...), and
step times.

    python tools/tpu_gap.py --out "$OUT"        # a TPU
    python tools/tpu_gap.py --out /tmp/x --smoke   # CPU: lowers, counts, no timing
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# a pinned copy of smartvjp/ (git archive of a commit), where one is beside
# this script: the device copies a working tree whose smartvjp/ may be mid-edit
PINNED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_gap_pkg")
sys.path.insert(0, os.path.join(ROOT, "design", "upstream"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
if os.path.isdir(os.path.join(PINNED, "smartvjp")):
  sys.path.insert(0, PINNED)
  # an editable install's finder would find the checkout's smartvjp/ first
  sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in
                      getattr(f, "__name__", type(f).__name__).lower()]
import smartvjp  # noqa: E402,F401  (before the benchmarks put the checkout first)
import tpu_figure as FIG  # noqa: E402
TA = FIG.TA
import accel_profile as AP  # noqa: E402

from jax._src.pallas import cost_estimate as CE  # noqa: E402
from smartvjp import _primitive as P  # noqa: E402
import smartvjp  # noqa: E402

T0 = time.perf_counter()


def commit():
  c = os.environ.get("SMARTVJP_COMMIT")
  if c:
    return c
  try:
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
  except OSError:
    return "unknown"


# -- the cells' modules --------------------------------------------------------------

class Unjitted:
  """A module's ``flash_attention`` without its ``jax.jit``."""

  def __init__(self, mod):
    self.mod = mod

  def flash_attention(self, *args, **kwargs):
    return self.mod.flash_attention.__wrapped__(*args, **kwargs)


@contextlib.contextmanager
def zero_flops(mod):
  """The shipped module's forward kernel traced with 0 flops and 0
  transcendentals in its cost estimate (bytes unchanged)."""
  orig = mod._fwd_cost_estimate

  def zero(*args, **kwargs):
    c = orig(*args, **kwargs)
    return type(c)(flops=0, transcendentals=0, bytes_accessed=c.bytes_accessed)
  mod._fwd_cost_estimate = zero
  try:
    yield
  finally:
    mod._fwd_cost_estimate = orig


SMART_PRIMS = (("call_p", "_call_code"), ("rule_p", "_rule_code"),
               ("rem_p", "_rem_code"))


def cost_rule_registered() -> dict:
  return {name: getattr(P, name) in CE._cost_rules
          for name, _ in SMART_PRIMS if hasattr(P, name)}


def register_cost_rules() -> dict:
  """The fix, applied from outside: Pallas' cost estimate recurses into the
  code a smartvjp primitive runs, as it does for ``custom_vjp_call``."""
  before = cost_rule_registered()
  for name, code_name in SMART_PRIMS:
    prim, code_of = getattr(P, name, None), getattr(P, code_name, None)
    if prim is None or code_of is None or prim in CE._cost_rules:
      continue

    def rule(ctx, _code_of=code_of, **params):
      del ctx
      c = CE.cost_estimate_jaxpr(P.live_code(_code_of(**params)))
      return CE.CostEstimate(flops=c.flops, transcendentals=c.transcendentals,
                             bytes_accessed=c.bytes_accessed)
    CE.register_cost_rule(prim, rule)
  return before


# -- reading programs ----------------------------------------------------------------

def kernel_costs(lowered_text: str) -> list:
  """``[(kernel_name, cost_estimate or None)]`` of the Mosaic calls of a
  lowered module."""
  out = []
  for line in lowered_text.splitlines():
    if "@tpu_custom_call" not in line:
      continue
    name = re.search(r'kernel_name = "([^"]+)"', line)
    cfg = re.search(r'backend_config = "([^"]*)"', line)
    cost = None
    if cfg:
      s = re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)),
                 cfg.group(1))
      try:
        cost = json.loads(s)["custom_call_config"].get("cost_estimate")
      except (ValueError, KeyError):
        cost = "unparsed"
    nres = line.split("->")[-1].count("tensor<")
    out.append(dict(kernel=name.group(1) if name else "?", outputs=nres,
                    cost_estimate=cost))
  return out


_HEAD = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")


def compiled_stats(text: str) -> dict:
  """Instructions of optimized HLO text: by opcode, per computation kind
  (entry, while body/condition, fusion, other), and what the computations
  called by ``while`` hold."""
  comps, cur, entry = {}, None, None
  for line in text.splitlines():
    h = _HEAD.match(line)
    if h and "=" not in line.split("{")[0]:
      cur = h.group(2)
      comps[cur] = []
      if h.group(1):
        entry = cur
      continue
    m = _INSTR.match(line)
    if m and cur is not None:
      comps[cur].append((m.group(1), line))
  by_op = collections.Counter(op for c in comps.values() for op, _ in c)
  called = collections.defaultdict(set)   # computation -> how it is called
  for c in comps.values():
    for op, line in c:
      for attr in ("body", "condition", "calls", "to_apply",
                   "true_computation", "false_computation"):
        for m in re.finditer(attr + r"=%?([\w.\-]+)", line):
          called[m.group(1)].add(f"{op}.{attr}")
  kinds = collections.Counter()
  nonfusion = collections.Counter()
  for name, c in comps.items():
    how = called.get(name, set())
    kind = ("entry" if name == entry else "while_body" if "while.body" in how
            else "while_cond" if "while.condition" in how
            else "fusion" if any(h.startswith("fusion.") for h in how)
            else "other")
    kinds[kind] += len(c)
    if kind != "fusion":
      nonfusion.update(op for op, _ in c)
  return dict(chars=len(text), computations=len(comps),
              instructions=sum(by_op.values()), by_kind=dict(kinds),
              by_op=dict(sorted(by_op.items())),
              scheduled_ops=dict(sorted(nonfusion.items())),
              copies=by_op["copy"] + by_op["copy-start"],
              transposes=by_op["transpose"],
              custom_calls=by_op["custom-call"],
              fusions=by_op["fusion"], mosaic=text.count("tpu_custom_call"))


def profile(compiled, args, steps, text):
  with tempfile.TemporaryDirectory() as tdir:
    ops, _planes, wall = AP.profile_row(compiled, args, steps, tdir)
  index = AP.hlo_index(text)
  s = AP.summarize(ops, index, steps, top=20)
  kernels = collections.defaultdict(lambda: [0.0, 0.0])
  by_opname = collections.defaultdict(float)
  for name, ns in ops:
    info = index.get(AP.event_instruction(name))
    if info is not None and info["opcode"] in AP.CONTAINERS:
      continue
    cls = AP.op_class(info)
    if cls.startswith("kernel "):
      kernels[cls][0] += ns / steps / 1e6
      kernels[cls][1] += 1 / steps
    key = f"{cls} | {(info or {}).get('op_name', '?')}"
    by_opname[key] += ns / steps / 1e6
  s["kernels"] = {k: dict(ms=v[0], runs=v[1]) for k, v in sorted(kernels.items())}
  s["by_class_opname"] = dict(sorted(by_opname.items(), key=lambda kv: -kv[1]))
  s["wall_ms"] = wall * 1e3
  s["idle_ms"] = wall * 1e3 - s["busy_ms"]
  for r in s["top"]:
    r["name"] = r["name"][:160]
  return s


def diff_classes(a: dict, b: dict) -> dict:
  keys = set(a) | set(b)
  d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in keys}
  return dict(sorted(((k, v) for k, v in d.items() if abs(v) > 1e-3),
                     key=lambda kv: -abs(kv[1])))


# -- the run -------------------------------------------------------------------------

def attention(doc, save, args, on_tpu):
  cfg = TA.TPU_CONFIG if on_tpu else TA.SMOKE_CONFIG
  params, x = TA.init_params(cfg, jax.random.key(0))
  doc["attention"] = dict(config=dict(cfg.__dict__) if hasattr(cfg, "__dict__")
                          else str(cfg), policies={})
  shipped = FIG.module("False")
  swapped = FIG.module("smartvjp")
  true_mod = FIG.module("True")
  doc["cost_rule_registered_at_start"] = cost_rule_registered()
  for pname in args.policies:
    policy = TA.POLICIES[pname]
    pol = doc["attention"]["policies"][pname] = dict(cells={})
    cells = pol["cells"]
    compiled, texts = {}, {}

    def build(name, mod, ctx=contextlib.nullcontext):
      cell = cells[name] = {}
      try:
        with ctx():
          step = TA.make_step(cfg, mod, policy)
          traced = step.trace(params, x)
          lowered = (traced.lower() if on_tpu else
                     traced.lower(lowering_platforms=("tpu",)))
          ltext = lowered.as_text()
        cell["lowered_chars"] = len(ltext)
        cell["lowered_func_calls"] = len(re.findall(r"\bcall @(?!tpu_custom)", ltext))
        cell["kernels"] = kernel_costs(ltext)
        cell["launches"] = TA.launches(step, params, x) if not on_tpu else None
        if on_tpu:
          c = lowered.compile()
          compiled[name] = c
          texts[name] = c.as_text()
          cell["compiled"] = compiled_stats(texts[name])
      except Exception as e:  # noqa: BLE001 -- recorded
        cell["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        cell["traceback"] = traceback.format_exc()[-2500:]
      print(pname, name, {k: v for k, v in cell.items()
                          if k in ("lowered_chars", "lowered_func_calls", "error")},
            [(k["kernel"], k["outputs"], (k["cost_estimate"] or {}).get("flops")
              if isinstance(k["cost_estimate"], dict) else k["cost_estimate"])
             for k in cell.get("kernels", [])], flush=True)
      save()

    build("False", shipped)
    build("True", true_mod)
    build("smartvjp", swapped)
    build("smartvjp_unjitted", Unjitted(swapped))
    build("True_cost0", true_mod, lambda: zero_flops(true_mod.mod))
    before = register_cost_rules()
    doc.setdefault("cost_rule_registered_before_fix", before)
    # a new swapped copy: the old one's jit cache holds its earlier trace
    build("smartvjp_costrule", FIG.module("smartvjp"))
    build("smartvjp_costrule_unjitted", Unjitted(FIG.module("smartvjp")))
    if not on_tpu:
      continue
    outs = {}
    for k, fn in compiled.items():
      outs[k] = jax.block_until_ready(fn(params, x))
    for k in outs:
      cells[k]["bitwise_equal_to_False"] = TA.EX.bitwise_equal(outs["False"], outs[k])
    keys = list(compiled)
    times = {k: [] for k in keys}
    for r in range(args.rounds):
      for k in keys[r % len(keys):] + keys[:r % len(keys)]:
        t0 = time.perf_counter()
        for _ in range(args.inner):
          out = compiled[k](params, x)
        jax.block_until_ready(out)
        times[k].append((time.perf_counter() - t0) / args.inner * 1e3)
    for k, ts in times.items():
      s = sorted(ts)
      cells[k]["step_ms"] = dict(median=s[len(s) // 2], min=s[0], max=s[-1],
                                 samples=s, inner=args.inner)
      print(pname, k, "step ms", round(s[len(s) // 2], 3), round(s[0], 3),
            round(s[-1], 3), flush=True)
    save()
    if time.perf_counter() - T0 > args.budget - 60:
      pol["profile_skipped"] = "time"
      continue
    for k in keys:
      try:
        cells[k]["profile"] = profile(compiled[k], (params, x), args.steps, texts[k])
        p = cells[k]["profile"]
        print(pname, k, "profile: wall", round(p["wall_ms"], 2), "busy",
              round(p["busy_ms"], 2), {c: round(v, 2) for c, v in
                                       list(p["classes"].items())[:6]}, flush=True)
      except Exception as e:  # noqa: BLE001
        cells[k]["profile_error"] = f"{type(e).__name__}: {str(e)[:400]}"
      save()
    ref = cells.get("True", {}).get("profile")
    if ref:
      for k in keys:
        p = cells[k].get("profile")
        if p and k != "True":
          p["minus_True"] = dict(
              wall_ms=p["wall_ms"] - ref["wall_ms"],
              busy_ms=p["busy_ms"] - ref["busy_ms"],
              classes=diff_classes(ref["classes"], p["classes"]),
              by_class_opname=dict(list(diff_classes(
                  ref["by_class_opname"], p["by_class_opname"]).items())[:25]))
    save()
    if args.hlo_dir:
      os.makedirs(args.hlo_dir, exist_ok=True)
      for k, t in texts.items():
        with gzip.open(os.path.join(args.hlo_dir, f"{pname}_{k}.hlo.txt.gz"),
                       "wt") as fh:
          fh.write(t)


def megablox(doc, save, args, on_tpu):
  import megablox_tpu as M
  if args.megablox_shape:   # tokens, width, expert width, experts, layers
    m, k, n, g, layers = args.megablox_shape
    M.SHAPES = dict(m=m, k=k, n=n, groups=g, layers=layers)
    # uneven routing with one empty expert, in tiles of 128 tokens
    tiles = [((i * 5) % 7) for i in range(g)]
    tiles[g // 2] = 0
    scale = (m // 128) / sum(tiles)
    sizes = [int(t * scale) * 128 for t in tiles]
    sizes[0] += m - sum(sizes)
    M.GROUP_SIZES = tuple(sizes)
  mods = M.modules()
  margs = M.inputs(**M.SHAPES)
  rec = doc["megablox"] = dict(shapes=M.SHAPES, group_sizes=M.GROUP_SIZES,
                               variants={})
  for checkpoint, scan in ((True, True), (False, True)):
    v = rec["variants"][f"checkpoint={checkpoint} scan={scan}"] = {}
    steps = {side: M.step(m, checkpoint, scan) for side, m in mods.items()}
    comp = {}
    for side, fn in steps.items():
      ltext = M.lowered_for_tpu(fn, *margs)
      v[side] = dict(lowered_ops=sum(M.lowered_ops(ltext).values()),
                     lowered_chars=len(ltext))
      if on_tpu:
        comp[side] = fn.lower(*margs).compile()
        v[side]["compiled"] = compiled_stats(comp[side].as_text())
    if on_tpu:
      for c in comp.values():
        jax.block_until_ready(c(*margs))
      times = {s: [] for s in comp}
      keys = list(comp)
      for r in range(args.rounds):
        for s in keys[r % 2:] + keys[:r % 2]:
          t0 = time.perf_counter()
          for _ in range(args.inner * 4):
            out = comp[s](*margs)
          jax.block_until_ready(out)
          times[s].append((time.perf_counter() - t0) / (args.inner * 4) * 1e3)
      for s, ts in times.items():
        ts = sorted(ts)
        v[s]["step_ms"] = dict(median=ts[len(ts) // 2], min=ts[0], max=ts[-1])
    print("megablox", checkpoint, scan, json.dumps(
        {s: {k: (x if not isinstance(x, dict) else
                 {kk: vv for kk, vv in x.items() if kk in
                  ("instructions", "by_kind", "median", "min", "max")})
             for k, x in d.items()} for s, d in v.items()}), flush=True)
    save()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--policies", nargs="+", default=["nothing_saveable"],
                 choices=list(TA.POLICIES))
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--inner", type=int, default=5)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--budget", type=float, default=540)
  p.add_argument("--skip-megablox", action="store_true")
  p.add_argument("--skip-attention", action="store_true")
  p.add_argument("--megablox-shape", type=int, nargs=5, default=None,
                 metavar=("M", "K", "N", "G", "L"),
                 help="tokens, width, expert width, experts, layers "
                 "(default: megablox_tpu.py's toy shapes)")
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args(argv)
  on_tpu = jax.default_backend() == "tpu" and not args.smoke
  os.makedirs(args.out, exist_ok=True)
  args.hlo_dir = os.path.join(args.out, "hlo") if on_tpu else None
  doc = dict(commit=commit(), jax=jax.__version__, backend=jax.default_backend(),
             devices=[str(d) for d in jax.devices()], argv=sys.argv[1:],
             smartvjp=getattr(smartvjp, "__version__", "?"),
             smartvjp_path=os.path.dirname(smartvjp.__file__),
             pinned=open(os.path.join(PINNED, "COMMIT")).read().strip()
             if os.path.exists(os.path.join(PINNED, "COMMIT")) else None,
             started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
  path = os.path.join(args.out, "tpu_gap.json")

  def save():
    doc["seconds"] = round(time.perf_counter() - T0, 1)
    with open(path, "w") as fh:
      json.dump(doc, fh, indent=1)

  try:
    if not args.skip_attention:
      attention(doc, save, args, on_tpu)
  except Exception as e:  # noqa: BLE001
    doc["attention_error"] = traceback.format_exc()[-3000:]
    print("attention ERROR", e, flush=True)
  save()
  if not args.skip_megablox and time.perf_counter() - T0 < args.budget - 90:
    try:
      megablox(doc, save, args, on_tpu)
    except Exception as e:  # noqa: BLE001
      doc["megablox_error"] = traceback.format_exc()[-3000:]
      print("megablox ERROR", e, flush=True)
  save()
  print(f"wrote {path} in {doc['seconds']} s")


if __name__ == "__main__":
  main()
