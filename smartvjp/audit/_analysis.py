"""The audit's analysis: trace and compile a step under each configuration,
count each site's rule runs, and describe its residuals, hazards and the
predicted effect of the swap (``smartvjp.audit`` is the public face)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import time
from typing import Any, Callable

import jax
import numpy as np

from smartvjp.audit import _calibrate
from smartvjp.audit import _count as C
from smartvjp.audit import _model as M
from smartvjp.audit import _trace as T
from smartvjp import _facade as jx
from smartvjp import _jaxprs
from smartvjp import _primitive as P
from smartvjp import _swap

SCHEMA = "smartvjp.audit/2"


class AuditError(ValueError):
  """The audit cannot describe this program; the message says why and what
  to do."""


# -- what an equation runs of other jaxprs ------------------------------------------

def _policy_name(policy) -> str:
  if policy is None:
    return "nothing_saveable"
  name = getattr(policy, "__name__", None)
  if name:
    return name
  names = getattr(policy, "names", None) or getattr(
      policy, "names_which_can_be_saved", None)
  return f"{type(policy).__name__}({', '.join(map(str, names or ()))})"


def _label(eqn):
  """How ``count_jaxpr`` names what ``eqn`` runs: ``(text, policy)``
  (``policy``: a checkpoint's, else ``None``), or ``None`` (smartvjp's own
  primitives, which run their rules inline)."""
  name = eqn.primitive.name
  if P.code_of(eqn) is not None:
    return None
  if name == "shard_map":
    return (name, ("shards", shards(eqn.params)))
  if name == "xla_pmap":
    return (name, ("shards", int(eqn.params.get("axis_size") or 1)))
  if name in ("remat2", "checkpoint", "remat"):
    policy = eqn.params.get("policy")
    return (f"checkpoint({_policy_name(policy)})", ("policy", policy))
  remat3 = jx.remat_policy_of(eqn)
  if remat3 is not None:
    # under the remat3 flags (jax 0.11+): a rematerialized region is a
    # call_hi_primitive whose _prim (RematTraced) holds the policy
    return (f"checkpoint({_policy_name(remat3[0])})", ("policy", remat3[0]))
  if name in ("pjit", "jit", "closed_call", "core_call"):
    return (f"jit({eqn.params.get('name', '')})", None)
  return None


def shards(params: dict) -> int:
  """How many devices a ``shard_map`` runs its body on, each with its own
  shard (the shapes its body traced with): the product of the sizes of
  the mesh axes it makes manual (``newly_manual_axes``; all of the
  mesh's where it does not say)."""
  mesh = params.get("mesh")
  shape = dict(getattr(mesh, "shape", {}) or {})
  axes = params.get("newly_manual_axes") or params.get("manual_axes") or shape
  return math.prod(int(shape.get(a, 1)) for a in axes) or 1


def sub_jaxprs(eqn):
  """``(kind, [(jaxpr, label)])`` for ``_count.count_jaxpr``, from the
  one walker (``_jaxprs.inner_jaxprs``); a label is ``(text,
  policy)`` (``_label``), for loops ``((text, None), trips)``."""
  subs = _jaxprs.inner_jaxprs(eqn)
  if not subs:
    return None, []
  if subs[0].kind == "loop":
    n = subs[0].trips
    text = "while" if n is None else f"scan(×{n})"
    return "loop", [(s.jaxpr, ((text, None), n)) for s in subs]
  if subs[0].kind == "branch":
    return "branches", [(s.jaxpr, ("cond", None)) for s in subs]
  label = _label(eqn)
  return "inline", [(s.jaxpr, label) for s in subs]


def _name_stack(eqn) -> str:
  return str(eqn.source_info.name_stack)


# -- one configuration: trace, lower, compile, count ---------------------------------

@dataclasses.dataclass
class Build:
  config: str
  error: str | None = None
  closed: Any = None
  hlo: str | None = None
  compiled: Any = None
  memory: dict = dataclasses.field(default_factory=dict)
  cost: dict = dataclasses.field(default_factory=dict)
  seconds: dict = dataclasses.field(default_factory=dict)
  lowered: Any = None
  jaxpr_count: Any = None
  hlo_count: Any = None
  calls: dict = dataclasses.field(default_factory=dict)
  loop_cost: dict = dataclasses.field(default_factory=dict)
  loop_notes: list = dataclasses.field(default_factory=list)
  rules: dict = dataclasses.field(default_factory=dict)   # site -> Rules
  sites: dict = dataclasses.field(default_factory=dict)   # as T.recording's


def _jitted(fn):
  return fn if jx.is_jit_function(fn) else jax.jit(fn)


def _memory(compiled) -> dict:
  try:
    m = compiled.memory_analysis()
  except Exception:   # noqa: BLE001  (best effort per backend)
    return {}
  if m is None:
    return {}
  fields = ("temp_size_in_bytes", "argument_size_in_bytes",
            "output_size_in_bytes", "alias_size_in_bytes",
            "generated_code_size_in_bytes")
  out = {f.removesuffix("_size_in_bytes"): int(getattr(m, f, 0) or 0)
         for f in fields}
  out["peak"] = out["temp"] + out["argument"] + out["output"] - out["alias"]
  return out


def _cost(stage) -> dict:
  """XLA's ``cost_analysis`` of a compiled (or lowered) program: ``flops``,
  ``transcendentals``, ``bytes_accessed`` (``{}`` where unavailable)."""
  try:
    c = stage.cost_analysis()
  except Exception:   # noqa: BLE001
    return {}
  c = c[0] if isinstance(c, (list, tuple)) and c else c
  return {"flops": float(c.get("flops", 0.0)),
          "transcendentals": float(c.get("transcendentals", 0.0)),
          "bytes_accessed": float(c.get("bytes accessed", 0.0))} if c else {}


def build(config: str, fn, args, kwargs, sites: dict) -> Build:
  """Traces and lowers ``fn`` under ``config`` (``compile`` compiles)."""
  b = Build(config)
  t0 = time.perf_counter()
  with T.recording(config, sites) as rec:
    traced = _jitted(fn).trace(*args, **kwargs)
    b.seconds["trace"] = time.perf_counter() - t0
    b.closed = traced.jaxpr
    t1 = time.perf_counter()
    b.lowered = traced.lower()
    donated = [a for a in jax.tree.leaves(
        b.lowered.args_info, is_leaf=lambda x: hasattr(x, "donated"))
               if getattr(a, "donated", False)]
    if donated:
      raise AuditError(
          f"smartvjp.audit: {len(donated)} argument(s) of the step are "
          "donated (donate_argnums/donate_argnames): the audit compiles the "
          "step several times and, with measure=True, runs each version on "
          "the same arguments. Audit the function without donation (the "
          "undecorated function, or jax.jit(fn) without donate_argnums)")
    b.seconds["lower"] = time.perf_counter() - t1
  b.calls, b.sites = rec.calls, sites
  return b


def compile_build(b: Build) -> Build:
  t = time.perf_counter()
  b.compiled = b.lowered.compile()
  b.seconds["compile"] = time.perf_counter() - t
  b.hlo = b.compiled.as_text()
  b.memory, b.cost = _memory(b.compiled), _cost(b.compiled)
  return b


def _try_compile(b: Build) -> str | None:
  try:
    compile_build(b)
  except Exception as e:   # noqa: BLE001  (reported per configuration)
    return f"{type(e).__name__}: {str(e).strip()[:500]}"
  return None


def count(b: Build, per_run: Callable) -> None:
  b.jaxpr_count = C.count_jaxpr(b.closed.jaxpr, sub_jaxprs, _name_stack, per_run)
  if b.hlo is not None:
    b.hlo_count = C.count_hlo(b.hlo, per_run)


# -- each site's own rules, traced alone ---------------------------------------------

@dataclasses.dataclass
class Rules:
  jaxprs: dict                 # role -> ClosedJaxpr (where it traced)
  residuals: list              # [{path, shape, dtype, bytes, name, source}]
  res_eqns: list               # producing equation of each residual or None
  num_out: int
  errors: dict


def _full(site, call, dyn):
  args, it = [], iter(dyn)
  n = len(call.static) + len(dyn)
  for i in range(n):
    args.append(call.static[i] if i in call.static else next(it))
  return args


def _sds(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def trace_rules(site, call) -> Rules:
  jaxprs, errors, residuals, res_eqns, num_out = {}, {}, [], [], 0
  wrap = ((lambda x: jx.cd.CustomVJPPrimal(x, True)) if site.symbolic_zeros
          else (lambda x: x))

  def make(role, fn, *dyn_trees, post=None):
    try:
      closed, shape = jax.make_jaxpr(fn, return_shape=True)(*dyn_trees)
      jaxprs[role] = closed
      return shape
    except Exception as e:   # noqa: BLE001  (reported, not raised)
      errors[role] = f"{type(e).__name__}: {e}"[:300]
      return None

  dyn = call.args
  make("f", lambda *d: site.fun(*_full(site, call, d)), *dyn)
  out_shape = None
  if site.fwd is not None:
    shape = make("fwd", lambda *d: site.fwd(*_full(site, call, [
        jax.tree.map(wrap, x) for x in d])), *dyn)
    if shape is not None:
      out_shape, res_shape = shape
      num_out = len(jax.tree.leaves(out_shape))
      closed = jaxprs["fwd"]
      producers = {id(v): e for e in closed.jaxpr.eqns for v in e.outvars}
      invars = {id(v) for v in closed.jaxpr.invars}
      leaves = jax.tree_util.tree_leaves_with_path(res_shape)
      outvars = closed.jaxpr.outvars[num_out:]
      for (path, leaf), var in zip(leaves, outvars):
        eqn = producers.get(id(var))
        source = ("input" if id(var) in invars else
                  "computed" if eqn is not None else "constant")
        residuals.append(dict(
            path=jax.tree_util.keystr(path) or "res", shape=list(leaf.shape),
            dtype=str(leaf.dtype),
            bytes=int(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize),
            name=jx.checkpoint_name_of(eqn.primitive, eqn.params)
            if eqn is not None else None, source=source))
        res_eqns.append(eqn)
      if site.bwd is not None:
        ct = _sds(out_shape)
        statics = [call.static[i] for i in sorted(call.static)]
        make("bwd", lambda r, g: site.bwd(*statics, r, g),
             _sds(res_shape), ct)
  if site.fwd_bwd is not None:
    if out_shape is None and "f" in jaxprs:
      out_shape = jax.eval_shape(lambda *d: site.fun(*_full(site, call, d)),
                                 *dyn)
    if out_shape is not None:
      make("fwd_bwd", lambda g, *d: site.fwd_bwd(*_full(site, call, d), g),
           _sds(out_shape), *dyn)
  return Rules(jaxprs, residuals, res_eqns, num_out, errors)


def _primitives(jaxpr):
  """Every equation of ``jaxpr`` at any depth (the one walker)."""
  return (eqn for eqn, _ in _jaxprs.equations(jaxpr))


def opaque_count(closed) -> int:
  """Kernel launches per run of ``closed`` at any depth, loops per trip
  (``_jaxprs.kernel_totals``)."""
  if closed is None:
    return 0
  return int(_jaxprs.kernel_totals(closed)["kernels"])


_COST_KEYS = ("flops", "transcendentals", "bytes_accessed")


def _zero() -> dict:
  return dict.fromkeys(_COST_KEYS, 0.0)


def compiled_trips(hlo: str) -> set:
  """The trip counts of the ``while`` loops of a compiled program's HLO
  text (``None`` for one whose count it does not state)."""
  comps, _ = C.parse_hlo(hlo)
  return {ins.trips if ins.trips is not None
          else C.condition_bound(comps, ins.callees.get("condition"))
          for instrs in comps.values() for ins in instrs
          if ins.opcode == "while"}


def _compiled_cost(fn, avals) -> tuple[dict, set]:
  """``fn`` compiled alone for ``avals``: XLA's ``cost_analysis`` of the
  compiled program (after fusion, as the step runs it) and its loops'
  trip counts (``compiled_trips``)."""
  compiled = jax.jit(fn).lower(
      *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]).compile()
  return _cost(compiled), compiled_trips(compiled.as_text())


def _kernel_adjustment(jaxpr, cache: dict) -> tuple[dict, int]:
  """Per kernel in ``jaxpr`` stating a cost (``kernel_cost_estimate``;
  each once, in loops too: the loop correction scales them): its estimate
  less what XLA's analysis sees of it compiled alone (a compiled kernel
  is a custom call XLA may count as nothing; an interpreted one is the
  interpreter's loop), so that XLA's figure for the whole plus this counts
  each kernel at its estimate; and how many kernels state none."""
  total, missing = _zero(), 0
  for eqn in _primitives(jaxpr):
    if not _jaxprs.is_opaque_kernel(eqn):
      continue
    est = _jaxprs.kernel_cost_estimate(eqn)
    if est is None:
      missing += eqn.primitive.name == "pallas_call"
      continue
    key = ("kernel", id(eqn))
    if key not in cache:
      try:
        seen = _compiled_cost(
            lambda *a, e=eqn: e.primitive.bind(*a, **e.params),
            [v.aval for v in eqn.invars])[0]
      except Exception:   # noqa: BLE001  (then XLA saw nothing of it)
        seen = {}
      cache[key] = (eqn, seen)
    seen = cache[key][1]
    for k in total:
      total[k] += est[k] - seen.get(k, 0.0)
  return total, missing


def rule_cost(closed, cache: dict | None = None) -> dict:
  """A traced jaxpr's own cost, one run (a rule's, or a loop's body), from
  compiled programs only: XLA's ``cost_analysis`` of it compiled alone,
  each kernel at its own cost estimate (``_kernel_adjustment``), and its
  loops scaled by their trip counts (``loop_correction``, kept apart in
  ``"loops"``)."""
  cache = {} if cache is None else cache
  if ("rule", id(closed)) in cache:
    return cache[("rule", id(closed))][1]
  try:
    xla, trips = _compiled_cost(jx.jaxpr_as_fun(closed), closed.in_avals)
    error = None
  except Exception as e:   # noqa: BLE001  (reported, not raised)
    xla, trips, error = {}, set(), f"{type(e).__name__}: {str(e)[:200]}"
  pallas, missing = _kernel_adjustment(closed.jaxpr, cache)
  notes: list = []
  loops = loop_correction(closed.jaxpr, trips, notes, cache)
  out = {k: max(xla.get(k, 0.0) + pallas[k] + loops[k], 0.0)
         for k in _COST_KEYS}
  out["loops"] = loops
  out["source"] = "xla+pallas_estimate" if any(
      _jaxprs.kernel_cost_estimate(e) for e in _primitives(closed.jaxpr)
  ) else "xla"
  if missing:
    out["pallas_calls_without_estimate"] = missing
  if error:
    out["error"] = error
  cache[("rule", id(closed))] = (closed, out)
  return out


def program_cost(closed, compiled_cost: dict, hlo: str, notes: list,
                 cache: dict) -> dict:
  """A compiled program's cost with its loops scaled: XLA's
  ``compiled_cost`` of it plus ``loop_correction`` (``closed``: its jaxpr,
  ``hlo``: its compiled text)."""
  if not compiled_cost:
    return {}
  fix = loop_correction(closed.jaxpr, compiled_trips(hlo), notes, cache)
  return {k: compiled_cost.get(k, 0.0) + fix.get(k, 0.0)
          for k in compiled_cost}


def loop_correction(jaxpr, trips: set, notes: list, cache: dict) -> dict:
  """What XLA's ``cost_analysis`` of a compiled program leaves out of its
  loops: it counts a ``while`` body once, whatever its trip count (checked
  in tests/test_audit_model.py). Per scan in ``jaxpr`` (a ``Jaxpr``) of
  length ``n`` unrolled ``u`` times (the ``u`` copies XLA counts), with
  ``own`` its body's cost compiled alone (``rule_cost``, its own loops
  scaled): ``(n - u) * own + u * own["loops"]``. ``trips``: the compiled
  program's loop trip counts (``compiled_trips``); a scan whose loop is not
  among them was unrolled by XLA, which then counted every copy."""
  total = _zero()
  for eqn in jaxpr.eqns:
    subs = _jaxprs.inner_jaxprs(eqn)
    if eqn.primitive.name == "scan":
      n, unroll = subs[0].trips, subs[0].unroll
      if n // unroll > 1 and n // unroll not in trips:
        notes.append(f"a scan of {n} is no loop in the compiled program "
                     "(XLA unrolled it): priced as compiled")
        continue
      own = rule_cost(eqn.params["jaxpr"], cache)
      for k in total:
        total[k] += (n - unroll) * own[k] + unroll * own["loops"][k]
      continue
    if subs and subs[0].kind == "loop":   # a while: trip count not known
      notes.append("a while loop's body is counted once in the step's cost "
                   "(trip count unknown)")
    parts = [loop_correction(s.jaxpr, trips, notes, cache) for s in subs]
    if subs and subs[0].kind == "branch":
      parts = [max(parts, key=lambda p: p["flops"] + p["bytes_accessed"])]
    for part in parts:
      for k in total:
        total[k] += part[k]
  return total


def hazards(site, rules: Rules, remat3: bool) -> list[str]:
  out = []
  if site.symbolic_zeros and remat3:
    out.append("symbolic_zeros=True under jax_remat3: JAX re-traces fwd for "
               "checkpoint_name and does not support symbolic zeros there "
               "(jax-ml/jax#40309)")
  f = rules.jaxprs.get("f")
  if f is not None and f.effects:
    out.append(f"f has effects ({', '.join(sorted(map(str, f.effects)))}): "
               "the swap runs f in the forward pass under jax.checkpoint, "
               "where JAX cannot differentiate a rule with effects; leave "
               "this site as it is, or move the effect out of f")
  fwd = rules.jaxprs.get("fwd")
  if fwd is not None:
    if any(np.ndim(c) > 0 for c in fwd.consts):
      out.append("fwd closes over array constants (they become inputs of "
                 "the staged rule; large ones are copied into the program)")
    if fwd.effects:
      out.append(f"fwd has effects ({', '.join(sorted(map(str, fwd.effects)))}"
                 "): a rule with effects is kept where it is, not moved")
    names = {e.primitive.name for e in _primitives(fwd.jaxpr)}
    if names & {"cond", "while"}:
      out.append("fwd has control flow (cond/while): optimize_remat=True "
                 "needs fwd traceable as one jaxpr (jax-ml/jax#22735)")
  for role, closed in rules.jaxprs.items():
    names = {e.primitive.name for e in _primitives(closed.jaxpr)}
    if names & C.COLLECTIVES:
      out.append(f"{role} has collectives ({', '.join(sorted(names & C.COLLECTIVES))}): "
                 "moving it moves communication (jax-ml/jax#28923)")
  return out


def saveable(policy, eqn) -> bool | str:
  """What ``policy`` answers for the equation producing a residual."""
  if policy is None or eqn is None:
    return False
  prim, params = eqn.primitive, eqn.params
  name = jx.checkpoint_name_of(prim, params)
  if name is not None:   # (under remat3, a high-level primitive: as name_p)
    prim, params = jx.ad_checkpoint.name_p, dict(name=name)
  try:
    ans = policy(prim, *[v.aval for v in eqn.invars], **params)
  except Exception:   # noqa: BLE001  (a policy that cannot answer: recompute)
    return False
  if jx.offload_space(ans) is not None:
    return "offloaded"
  if jx.is_recompute(ans):
    return False
  return bool(ans)


# -- the report ------------------------------------------------------------------------

_LIBRARY_DIRS = ("site-packages", "dist-packages")


def _fn_name(fn) -> str:
  return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) \
      or repr(fn)


def _remat3() -> dict:
  out = {}
  for flag in ("jax_remat3", "jax_custom_vjp3"):
    try:
      out[flag] = bool(getattr(jax.config, flag))
    except AttributeError:
      out[flag] = None
  return out


def _site_runs(b: Build, index: int) -> dict | None:
  if b is None or b.error is not None:
    return None
  jaxpr = C.per_site(b.jaxpr_count.runs).get(index, dict.fromkeys(C.ROLES, 0))
  out = {"jaxpr": jaxpr}
  if b.hlo_count is not None:
    out["compiled"] = C.per_site(b.hlo_count.runs).get(
        index, dict.fromkeys(C.ROLES, 0))
    out["kernel_launches"] = b.hlo_count.site_launches.get(index, 0)
  return out


def _fate(leaf, eqn, policy, remat, runs, opaque, fused) -> str:
  if leaf["source"] != "computed":
    return leaf["source"]
  if not remat:
    return "saved"
  s = saveable(policy, eqn)
  if s:
    return "offloaded" if s == "offloaded" else "saved"
  if fused or runs is None:
    return "recomputed"
  c = runs.get("compiled", runs["jaxpr"])
  return "dropped" if opaque and c["fwd"] > c["bwd"] else "recomputed"


# the swap is advised where a site's predicted saving is at least this
# share of the step; below it a measurement of the step cannot tell it
# from noise (issue 63: the paired IQR of a TPU step holds 1 below ~0.5%)
WORTH = _calibrate.WORTH


def _ran_fused(runs: dict | None) -> bool:
  """Whether a configuration's step really ran the fused ``fwd_bwd``."""
  if not runs:
    return False
  return bool(runs.get("compiled", runs["jaxpr"]).get("fwd_bwd"))


def _swap_line(info, how: str, share) -> str:
  """The swap's advice: with its fused rule only where the configuration
  priced really ran it."""
  fused = _ran_fused(info["runs"].get(info["best_config"]))
  line = f"swap: {how}" + (" and use its fwd_bwd" if fused else "")
  aw = info["runs"]["as_written"]
  sv = info["runs"][info["best_config"]]
  if info["opaque"]:
    a_fwd = aw.get("compiled", aw["jaxpr"])["fwd"]
    s_fwd = sv.get("compiled", sv["jaxpr"])["fwd"]
    line += (f" (fwd runs {a_fwd} -> {s_fwd} per step, "
             f"{info['predicted']['launches_saved']} kernel launches fewer, "
             f"{info['predicted']['dropped_bytes_saved']} bytes of dropped "
             "residual writes avoided"
             + (f"; predicted {share:.1%} of the step saved" if share
                is not None else "") + ")")
  else:
    line += f" (predicted {share:.1%} of the step saved)"
  return line


def leading_share(predicted: dict):
  """A site's predicted saving as a share of the step, from the estimate
  the report leads with: its rules timed alone (``calibrated``) where they
  were, else the time model's; ``None`` without either."""
  share = (predicted.get("calibrated") or {}).get("share_of_step")
  return share if share is not None else predicted.get("share_of_step")


def _saving_text(a) -> str:
  """The saving an advice was decided from, for people: its median share
  of the step and, for a timed or measured one, its 95% interval."""
  what = {"measured": "measured", "estimate": "predicted"}.get(a.source, "")
  iv = a.saving
  text = f"the swap's {what} saving is {iv.median:.2%} of the step"
  if iv.samples:
    text += f" (95% interval {iv.low:+.2%} to {iv.high:+.2%})"
  return text


def _advise(info) -> tuple[str, str]:
  """``(advice, suggestion)`` at a site: the advice (``"swap"``, ``"no
  action"`` or ``"cannot tell"``) decided by ``_calibrate.site_advice``
  from the interval of its saving (measured in the step where it was,
  else timed, else the time model's point), and one line of words that
  follow it; a fused rule only where a configuration ran it. Without any
  estimate, a kernel site's counts decide (fewer ``fwd`` runs or kernel
  launches: swap). ``info`` is a site of the report."""
  if info["refused"] is not None:
    return "no action", f"none: left as JAX's ({info['refused']})"
  aw = info["runs"].get("as_written")
  sv = info["runs"].get(info["best_config"])
  library = any(d in info["defined_at"] for d in _LIBRARY_DIRS)
  how = ("wrap the step's first trace in `with smartvjp.swap_custom_vjp("
         "existing=True):` (or load the library with smartvjp.import_swapped)"
         if library else
         f"decorate {info['name']} with smartvjp.smart_custom_vjp (one import)")
  if info["kind"] == "smart_custom_vjp":
    return "no action", "no action: already smart_custom_vjp"
  if aw is None or sv is None:
    missing = [c for c in dict.fromkeys(("as_written", info["best_config"]))
               if c not in info["runs"]]
    if missing:
      return "cannot tell", (
          "no suggestion: this audit compiled only "
          f"{', '.join(info['runs'])}; comparing needs "
          f"{' and '.join(missing)} too (smartvjp.audit(step))")
    return ("cannot tell",
            "no suggestion: a configuration did not trace (see errors)")
  idle = [r for r in ("f", "fwd") if r in info.get("no_work", ())]
  if len(idle) == 2 or (idle == ["fwd"] and not info["opaque"]):
    return "no action", (
        f"no action: {' and '.join(idle)} do{'es' if len(idle) == 1 else ''}"
        " no work (no operations), so running one in place of the other "
        "changes nothing")
  if not info["remat"]:
    return "no action", ("no action: no jax.checkpoint around this site, so "
                         "every configuration runs fwd once and bwd once per "
                         "call")
  a = _calibrate.site_advice(info)
  share = a.saving.median if a.saving is not None else None
  if a.source == "none" and info["opaque"]:   # no estimate: the counts say
    a_fwd = aw.get("compiled", aw["jaxpr"])["fwd"]
    s_fwd = sv.get("compiled", sv["jaxpr"])["fwd"]
    if info["predicted"]["launches_saved"] > 0 or s_fwd < a_fwd:
      return "swap", _swap_line(info, how, None)
    named = [r["name"] for r in info["residuals"] if r["name"]
             and r["fate"]["as_written"] != "saved"]
    if named:
      return "no action", (
          f"name-based policy: save residual {named[0]!r} with "
          f"jax.checkpoint_policies.save_only_these_names({named[0]!r})")
    return "no action", ("no action: the swap launches no fewer kernels "
                         "here and runs fwd no less often")
  if a.kind == "swap":
    return "swap", _swap_line(info, how, share)
  if a.kind == "cannot tell":
    return "cannot tell", (
        f"{a}: " + (_saving_text(a) + "; " if a.saving is not None else "")
        + "measure it in the step (smartvjp.audit(..., measure=True))")
  if not info["opaque"]:
    return "no action", (
        "no action: XLA already removes the duplicate (JAX-coded rules: "
        "XLA drops the work only the residuals need; "
        + _saving_text(a) + ")")
  if share < 0:
    return "no action", ("no action: the swap would cost time here ("
                         + _saving_text(a) + ")")
  return "no action", ("no action: " + _saving_text(a) + ", too small to "
                       f"act on (the swap is advised from {WORTH:.1%})")


def advise(info) -> tuple[str, str]:
  """``_advise(info)``, its words completed: where the time model could
  not price the site, and where the site has a ``fwd_bwd_opportunity``
  and the advice is to swap or to leave it, what a fused ``fwd_bwd``
  would save (``info`` is a site of the report)."""
  kind, text = _advise(info)
  if (info["predicted"].get("unpriced") and leading_share(info["predicted"])
      is None and text.startswith(("swap", "no action"))):
    text += f" (the time model: {UNPRICED})"
  opp = info.get("fwd_bwd_opportunity")
  if opp and text.startswith(("swap", "no action")):
    text += (f"; its backward region runs fwd then bwd {opp['runs']}x per "
             "step: a fwd_bwd (defvjp(fwd, bwd, fwd_bwd=...), one rule for "
             f"both) would not write {opp['residual_bytes_not_written']} "
             "bytes of residuals"
             + (f" and would make {opp['launches_not_made']} kernel "
                "launches fewer" if opp["launches_not_made"] else "")
             + " per step")
  return kind, text


def suggestion(info) -> str:
  """The words of ``advise(info)``."""
  return advise(info)[1]


_CALLBACKS = frozenset({"pure_callback", "io_callback", "callback"})


def _model_notes(out_sites: list, rule_jaxprs: dict) -> list:
  notes = []
  for s in out_sites:
    jaxprs = rule_jaxprs.get(s["index"], {})
    names = {e.primitive.name for j in jaxprs.values()
             for e in _primitives(j.jaxpr)}
    if s["predicted"].get("unpriced"):
      notes.append(
          f"{s['name']}: {UNPRICED} (its kernels, "
          + "; ".join(f"{r}: {', '.join(k)}" for r, k in
                      s["predicted"]["unpriced"].items())
          + ", state no cost XLA's analysis can see: the model gives the "
          "site no seconds, and the step's figure leaves them out)")
      continue
    missing = {role: c["pallas_calls_without_estimate"] for role, c in
               s["predicted"].get("rule_cost", {}).items()
               if c.get("pallas_calls_without_estimate")}
    if missing:
      notes.append(
          f"{s['name']}: pallas_call(s) without a cost_estimate in "
          + ", ".join(f"{r} ({n})" for r, n in missing.items())
          + ": where such a kernel is compiled (not interpreted), XLA's "
          "cost analysis counts nothing of it, so only its launches are "
          "priced; give "
          "pl.pallas_call a cost_estimate=pl.CostEstimate(...)")
    elif s["opaque"] and not names & _CALLBACKS and not any(
        c.get("flops") or c.get("bytes_accessed")
        for c in s["predicted"].get("rule_cost", {}).values()):
      notes.append(
          f"{s['name']}: its kernels have no cost XLA can see and no Pallas "
          "cost_estimate: only their launches are priced")
  return notes


UNPRICED = "unpriced: calibrate=True times it"


def unpriced_kernels(jaxpr) -> list[str]:
  """The kernels in ``jaxpr`` (any depth, every branch of a ``cond``)
  whose cost XLA's analysis cannot see: opaque kernels (the facade's one
  definition) that state no cost estimate (a host callback, an FFI or
  custom call, a compiled ``pallas_call`` without ``cost_estimate``),
  not a Pallas kernel run by its interpreter (plain HLO, which XLA
  costs). Their primitives' names, sorted."""
  return sorted({e.primitive.name for e in _primitives(jaxpr)
                 if _jaxprs.is_opaque_kernel(e) and _jaxprs.kernel_cost_estimate(e) is None
                 and not (e.primitive.name == "pallas_call"
                          and e.params.get("interpret"))})


def _site_model(info: dict, rules: Rules | None, builds: dict, best: str,
                peaks: dict, step_seconds: float | None, cache: dict) -> dict:
  """The site's predicted seconds per configuration and saving (the
  as-written seconds less ``best``'s), from its rules' own costs; where a
  rule holds a kernel XLA cannot cost (``unpriced_kernels``) the model
  abstains: ``seconds``, ``seconds_saved`` and ``share_of_step`` are
  ``None`` and ``unpriced`` names the rules and kernels (a ``cond``
  whose one branch is such a kernel and whose other is JAX code is
  unpriced too: XLA's analysis would take the branch it can see)."""
  unpriced = {role: u for role, j in (rules.jaxprs.items() if rules else ())
              if (u := unpriced_kernels(j.jaxpr))}
  costs = {role: rule_cost(j, cache) for role, j in (
      rules.jaxprs.items() if rules else ())}
  if unpriced:
    return dict(rule_cost=costs, seconds=None, seconds_saved=None,
                share_of_step=None, unpriced=unpriced)
  own = {role: M.seconds(c, 0, peaks)["total"] for role, c in costs.items()}
  per = {}
  for c in builds:
    runs = info["runs"].get(c)
    if runs is None:
      continue
    per[c] = M.site_seconds(runs.get("compiled", runs["jaxpr"]), own,
                            info["opaque"], runs.get("kernel_launches", 0),
                            peaks)
  saved = (per["as_written"] - per[best]
           if "as_written" in per and best in per else None)
  return dict(rule_cost=costs, seconds=per, seconds_saved=saved,
              share_of_step=(saved / step_seconds
                             if saved is not None and step_seconds else None))


def build_all(fn, args, kwargs, configs, sites: dict) -> tuple[dict, dict]:
  """Stage 1: ``({config: Build}, {config: error})``, each configuration
  traced, lowered and compiled (the compiles at once: XLA compiles without
  the GIL). ``smartvjp_fused`` is ``smartvjp``'s build where no site has a
  fused rule."""
  builds, errors = {}, {}
  for config in configs:
    if config == "smartvjp_fused" and "smartvjp" in builds and sites and not any(
        s.fwd_bwd is not None for s in sites.values()):
      builds[config] = builds["smartvjp"]
      continue
    try:
      builds[config] = build(config, fn, args, kwargs, sites)
    except AuditError:
      raise
    except Exception as e:   # noqa: BLE001  (reported per configuration)
      errors[config] = f"{type(e).__name__}: {str(e).strip()[:500]}"
  unique = list({id(b): b for b in builds.values()}.values())
  with concurrent.futures.ThreadPoolExecutor(len(unique) or 1) as pool:
    for b, result in zip(unique, pool.map(_try_compile, unique)):
      if result is not None:
        errors[b.config] = result
        builds = {c: x for c, x in builds.items() if x is not b}
  return builds, errors


def _check_found(name: str, builds: dict, errors: dict, sites: dict) -> None:
  if not builds:
    first = next(iter(errors.values()), "")
    raise AuditError(
        f"smartvjp.audit: {name} does not trace and compile under any "
        f"configuration; under {next(iter(errors))}: {first}")
  if not sites:
    raise AuditError(
        f"smartvjp.audit: {name} makes no jax.custom_vjp or "
        "smart_custom_vjp call: nothing to audit (a custom_vjp call that "
        "JAX traced before this process imported smartvjp is found too; "
        "check that the step differentiates the code you meant)")


def _calls(builds: dict, idx: int) -> list:
  return next((b.calls[idx] for b in builds.values() if idx in b.calls), [])


def _count_all(builds: dict, by_index: dict) -> dict:
  """Stage 2: each site's rules traced alone (``{index: Rules}``), and
  each build's counts (its kernels' launches per rule run from them)."""
  rules = {}
  for idx, site in by_index.items():
    calls = _calls(builds, idx)
    rules[idx] = trace_rules(site, calls[0]) if calls else None
  for b in builds.values():   # (read by _calibrate)
    b.rules = rules
  per_run = lambda key: opaque_count((rules.get(key[0]).jaxprs if rules.get(
      key[0]) else {}).get(key[2])) or 1
  for b in {id(b): b for b in builds.values()}.values():
    count(b, per_run)
  return rules


def _step_seconds(builds: dict, peaks, cache: dict) -> dict:
  """Stage 3: each build's cost with its loops scaled (``program_cost``)
  and its predicted seconds (``None`` without peaks)."""
  for b in {id(b): b for b in builds.values()}.values():
    notes: list = []
    b.loop_cost = program_cost(b.closed, b.cost, b.hlo, notes, cache)
    b.loop_notes = sorted(set(notes))
  out = {}
  for c, b in builds.items():
    launches = b.hlo_count.launches if b.hlo_count else 0
    out[c] = M.seconds(b.loop_cost, launches, peaks) if peaks else None
  return out


def _site_place(site, calls, ref: Build) -> dict:
  """Where a site is: its nesting path, checkpoint policy, whether it is
  rematerialized and how many times per step it is called."""
  idx = site.index
  paths = [p for key, ps in ref.jaxpr_count.paths.items() if key[0] == idx
           for p in ps]
  path = max(paths, key=len) if paths else ()
  policy_lbl = [lbl[1][1] for lbl in path if lbl[1] and lbl[1][0] == "policy"]
  remat = bool(policy_lbl) or any(
      lbl[1] and lbl[1][0] == "policy" for p in paths for lbl in p)
  # under jax_remat3 checkpoint leaves no equation, only its name stack
  remat3_only = not remat and any(
      key[0] == idx for key in ref.jaxpr_count.rematted)
  policy = policy_lbl[-1] if policy_lbl else None
  devices = math.prod(lbl[1][1] for lbl in path
                      if lbl[1] and lbl[1][0] == "shards")
  mult = sum(ref.jaxpr_count.multiplicity.get((idx, c), 0)
             for c in range(len(calls))) or len(calls)
  return dict(
      path=" › ".join(["jit"] + [lbl[0] for lbl in path]
                      + (["checkpoint(?)"] if remat3_only else [])),
      multiplicity=mult, shards=devices, remat=remat or remat3_only,
      policy_fn=policy,
      policy=("unknown (jax_remat3 leaves no checkpoint equation)"
              if remat3_only else _policy_name(policy)
              if remat or remat3_only else None),
      conditional=any(lbl[0] == "cond" for p in paths for lbl in p))


def _site_residuals(site, r, place, runs, opaque, builds) -> tuple:
  """Each residual's fate per configuration, and the bytes per fate."""
  residuals = []
  for leaf, eqn in zip(r.residuals if r else (), r.res_eqns if r else ()):
    leaf = dict(leaf)
    leaf["fate"] = {c: _fate(leaf, eqn, place["policy_fn"], place["remat"],
                             runs.get(c), opaque,
                             c == "smartvjp_fused" and site.fwd_bwd is not None)
                    for c in builds}
    residuals.append(leaf)
  totals = {}
  for c in builds:
    t = dict.fromkeys(("written", "saved", "dropped", "recomputed"), 0)
    for leaf in residuals:
      fate, n = leaf["fate"][c], leaf["bytes"] * place["multiplicity"]
      if fate in ("saved", "offloaded", "dropped"):
        t["written"] += n
      if fate in ("saved", "offloaded"):
        t["saved"] += n
      elif fate in ("dropped", "recomputed"):
        t[fate] += n
    totals[c] = t
  return residuals, totals


def no_work(rules) -> list[str]:
  """The roles whose traced rule does no work: no equation at any depth
  but calls of bodies that have none (optax's ``scale_gradient``: ``f``
  and ``fwd`` return their input). No count can be read for such a rule,
  in the jaxpr or compiled: nothing carries its name."""
  return [role for role, closed in (rules.jaxprs.items() if rules else ())
          if not any(not _jaxprs.inner_jaxprs(e) for e in _primitives(closed.jaxpr))]


def fwd_bwd_opportunity(site, rules, runs: dict | None, opaque: bool,
                        remat: bool, residuals: list) -> dict | None:
  """What a fused ``fwd_bwd`` would save a site that has none, where its
  backward region runs ``fwd`` then ``bwd`` (``runs``: its counts in the
  swapped step, ``"smartvjp"``): per such backward run, the residual bytes
  ``fwd`` computes and writes for ``bwd`` to read (leaves of ``source``
  ``computed``), and the kernel launches of ``fwd`` and ``bwd`` beyond
  the one a fused kernel makes. ``None`` where the site has a
  ``fwd_bwd``, is JAX-coded (XLA fuses across its rules already), has no
  remat around it (its backward pass reads saved residuals: no ``fwd``
  runs there), or its backward region runs no ``fwd``. ``{"runs", "residual_bytes_not_written",
  "launches_not_made"}``, per step."""
  if (site.fwd_bwd is not None or not opaque or not remat or not runs
      or rules is None):
    return None
  c = runs.get("compiled", runs["jaxpr"])
  n = min(c["fwd"], c["bwd"])
  if n <= 0:
    return None
  written = sum(leaf["bytes"] for leaf in residuals
                if leaf["source"] == "computed")
  kernels = (opaque_count(rules.jaxprs.get("fwd"))
             + opaque_count(rules.jaxprs.get("bwd")))
  return dict(runs=n, residual_bytes_not_written=n * written,
              launches_not_made=n * max(kernels - 1, 0))


def _role_fn(site, role):
  return getattr(site, role if role != "f" else "fun")


def _site_info(site, builds: dict, ref: Build, r, remat3: dict,
               failed=()) -> dict:
  """Stage 4, per site: identity, place, counts (``None`` under each
  configuration in ``failed``, which did not trace), residuals,
  hazards."""
  idx, calls = site.index, _calls(builds, site.index)
  place = _site_place(site, calls, ref)
  runs = {c: _site_runs(b, idx) for c, b in builds.items()}
  runs.update((c, None) for c in failed if c not in runs)
  kernels = max((v.get("kernel_launches", 0) for v in runs.values() if v),
                default=0)
  opaque = bool(kernels) or any(opaque_count(j) for j in (
      r.jaxprs.values() if r else ()))
  best = ("smartvjp_fused" if site.fwd_bwd is not None
          and "smartvjp_fused" in builds else "smartvjp")
  residuals, totals = _site_residuals(site, r, place, runs, opaque, builds)
  aw, sv = runs.get("as_written"), runs.get(best)
  launches_saved = ((aw or {}).get("kernel_launches", 0)
                    - (sv or {}).get("kernel_launches", 0)) if aw and sv else 0
  return dict(
      index=idx, name=site.name, kind=site.kind,
      rules={role: _swap.qualified(_role_fn(site, role)) for role in C.ROLES
             if _role_fn(site, role) is not None},
      defined_at=site.defined_at, called_at=[c.called_at for c in calls],
      path=place["path"], multiplicity=place["multiplicity"],
      shards=place["shards"],
      policy=place["policy"], remat=place["remat"], flags=remat3,
      conditional=place["conditional"], symbolic_zeros=site.symbolic_zeros,
      opaque=opaque, best_config=best, runs=runs, residuals=residuals,
      residual_bytes=totals,
      predicted=dict(launches_saved=launches_saved,
                     dropped_bytes_saved=totals.get("as_written", {}).get(
                         "dropped", 0) - totals.get(best, {}).get(
                             "dropped", 0)),
      unavailable=sorted(getattr(site, "unavailable", ())),
      no_work=no_work(r),
      fwd_bwd_opportunity=fwd_bwd_opportunity(
          site, r, runs.get("smartvjp") or runs.get("as_written"), opaque,
          place["remat"], residuals),
      rule_errors=r.errors if r else {}, refused=site.refused,
      hazards=hazards(site, r, bool(remat3.get("jax_remat3"))) if r else [])


def _step_report(builds: dict, step_seconds: dict) -> dict:
  step = {}
  for c, b in builds.items():
    launches = b.hlo_count.launches if b.hlo_count else None
    step[c] = dict(memory=b.memory, cost=b.cost, cost_loops_scaled=b.loop_cost,
                   kernel_launches=launches,
                   seconds=b.seconds, predicted_seconds=step_seconds[c],
                   notes=(b.jaxpr_count.notes + (b.hlo_count.notes
                                                 if b.hlo_count else [])
                          + b.loop_notes))
  return step


def _step_predicted(step: dict, best_step: str, out_sites: list,
                    peaks, unpriced: list) -> dict:
  """Stage 5: the whole step's predicted change, as written to swapped;
  ``partial`` where the time model's step leaves out kernels it cannot
  cost (``unpriced``: their names in the step as written; the sites
  holding them in ``unpriced_sites``)."""
  if "as_written" not in step or best_step not in step:
    return {}
  sites = [x["name"] for x in out_sites if x["predicted"].get("unpriced")]
  a, s = step["as_written"], step[best_step]
  ratio = lambda k: (s["cost"].get(k, 0) / a["cost"][k]
                     if a["cost"].get(k) else None)
  return dict(
      baseline="as_written", candidate=best_step,
      memory={k: s["memory"].get(k, 0) - v for k, v in a["memory"].items()},
      cost={k: s["cost"].get(k, 0) - v for k, v in a["cost"].items()},
      launches_saved=(a["kernel_launches"] or 0) - (s["kernel_launches"] or 0),
      bytes_accessed_ratio=ratio("bytes_accessed"), flops_ratio=ratio("flops"),
      predicted_ratio=M.ratio(s["predicted_seconds"], a["predicted_seconds"]),
      seconds_saved=(a["predicted_seconds"]["total"]
                     - s["predicted_seconds"]["total"]) if peaks else None,
      sites_seconds_saved=sum(x["predicted"].get("seconds_saved") or 0
                              for x in out_sites) if peaks else None,
      partial=bool(unpriced or sites), unpriced_kernels=unpriced,
      unpriced_sites=sites)


def _summary(out_sites: list, step: dict, builds: dict) -> dict:
  cvjp_saved = sum(s["residual_bytes"].get("as_written", {}).get("saved", 0)
                   for s in out_sites)
  temp = step.get("as_written", {}).get("memory", {}).get("temp")
  return dict(
      sites=len(out_sites),
      kernel_launches={c: v["kernel_launches"] for c, v in step.items()},
      residual_bytes={c: {k: sum(s["residual_bytes"].get(c, {}).get(k, 0)
                                 for s in out_sites)
                          for k in ("written", "saved", "dropped",
                                    "recomputed")} for c in builds},
      peak_bytes={c: v["memory"].get("peak") for c, v in step.items()},
      custom_vjp_saved_share_of_temp=(cvjp_saved / temp) if temp else None)


def analyse(fn, args, kwargs, configs=T.CONFIGS, peaks=None
            ) -> tuple[dict, dict]:
  """Trace and compile ``fn(*args, **kwargs)`` under ``configs``:
  ``(the report as plain data (schema: docs/audit.md), {config: Build})``.
  ``peaks``: the time model's overrides (``_model.peaks_for``). Stages:
  build, count, price the steps, describe and price each site, the step's
  prediction."""
  device = jax.devices()[0]
  peaks, peaks_source = M.peaks_for(device.device_kind, device.platform, peaks)
  sites: dict = {}
  t0 = time.perf_counter()
  builds, errors = build_all(fn, args, kwargs, configs, sites)
  name = _fn_name(fn)
  _check_found(name, builds, errors, sites)
  by_index = {s.index: s for s in sites.values()}
  rules = _count_all(builds, by_index)
  remat3 = _remat3()
  ref = builds.get("as_written", next(iter(builds.values())))
  best_step = ("smartvjp_fused" if "smartvjp_fused" in builds and any(
      s.fwd_bwd is not None for s in by_index.values()) else "smartvjp")
  cost_cache: dict = {}
  step_seconds = _step_seconds(builds, peaks, cost_cache)
  out_sites = []
  for idx, site in sorted(by_index.items()):
    info = _site_info(site, builds, ref, rules[idx], remat3, errors)
    if peaks:
      info["predicted"].update(_site_model(
          info, rules[idx], builds, info["best_config"], peaks,
          (step_seconds.get("as_written") or {}).get("total"), cost_cache))
    info["advice"], info["suggestion"] = advise(info)
    out_sites.append(info)
  out_sites.sort(key=lambda s: (-(s["predicted"].get("seconds_saved") or 0),
                                -s["predicted"]["launches_saved"],
                                -s["predicted"]["dropped_bytes_saved"],
                                s["index"]))
  step = _step_report(builds, step_seconds)
  seconds = time.perf_counter() - t0
  data = dict(
      schema=SCHEMA, function=name, jax_version=jax.__version__,
      backend=jax.default_backend(), flags=remat3,
      configs=list(builds), errors=errors, sites=out_sites, step=step,
      predicted=_step_predicted(step, best_step, out_sites, peaks,
                                unpriced_kernels(ref.closed.jaxpr)),
      model=dict(name=M.MODEL, device_kind=device.device_kind, peaks=peaks,
                 peaks_source=peaks_source,
                 notes=_model_notes(out_sites, {
                     i: r.jaxprs for i, r in rules.items() if r})),
      summary=_summary(out_sites, step, builds),
      audit_seconds=seconds,
      audit_cost_in_compiles=seconds / max(sum(ref.seconds.values()), 1e-9))
  return data, builds
