"""The audit's timed estimator (``calibrate=True``, implied by
``measure=True``): each site's rules timed on the values the step gives
them, the as-written step timed on the user's arguments, and each site's
saving predicted from its runs saved times its rules' times, as a share of
the measured step, with a 95% interval; then the advice, from that
interval (``advice``).

Where the time model (``_model``) prices a rule from XLA's cost analysis
and a table of peaks, this prices it from the clock: a host callback at
what the host takes, a kernel at what it takes, whatever XLA can see of
it. An operator-level benchmark beside an operator-level cost model, as
PyTorch's ``SACEstimator`` offers both; timed as benchmark harnesses
(pyperf, Criterion.rs, ``triton.testing.do_bench``) time: many runs per
sample, repeated until the estimate is stable, reported as an interval.

How (``attach``):

1. **Capture** (``capture``): the step is traced once more with every site
   as written, each rule wrapped so that a ``jax.debug.callback`` sends
   the values it is given to the host, and run once on the user's
   arguments (where they are ``jax.ShapeDtypeStruct``, on made-up values,
   ``made_up``; the report says which). A debug callback is an effect that
   no transformation removes or forbids: it runs under ``jit``, ``scan``
   and ``while`` (each iteration), ``jax.checkpoint`` (and again in the
   rematerialized region), ``vmap`` (batched values: the first example is
   kept) and ``shard_map`` (one shard's values, as the rule sees them).
   Up to ``SETS`` calls of each rule are kept, drawn uniformly from all its
   calls (reservoir sampling, Vitter's algorithm R), so that a rule called
   in every layer of a scan is timed on several layers' values. This is
   the audit's one extra trace and compile of the step, and its one extra
   run: effects in the step (an ``io_callback``) happen once more.
2. **Loop** (``_timing.loop_program``): each rule runs ``K`` times in one
   compiled loop, on its captured values in turn, each run's inputs
   depending on the previous run's outputs; ``K`` makes a sample at least
   ``_timing.TARGET_S`` long (``_timing.loop_length``), so that the
   dispatch of a sample is small against it and nothing is subtracted.
   The as-written step is timed beside them, looped the same way where one
   run is shorter than the target.
3. **Rounds** (``_timing.rounds``): every program once a round, the order
   rotated, until each one's median has a 95% interval within ±5% of it
   (``_timing.narrow``) or ``budget`` seconds pass (``"stopped"``:
   ``"converged"`` or ``"budget"``).
4. **Estimate**: per round, each site's saving is its runs per
   configuration times that round's rule times (``_model.site_seconds``)
   and its share is that over the same round's step: the share's interval
   is the order-statistics interval of those paired per-round shares
   (``_timing.median_interval``). A rule's time is what the clock gave:
   never clamped, never less an empty program's.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from smartvjp import _facade as jx
from smartvjp.audit import _model as M
from smartvjp.audit import _timing as TM
from smartvjp.audit import _trace as TR
from smartvjp.audit._timing import Interval

# the tolerance the audit is held to (issue 68): an estimate agrees with a
# measured saving within a quarter of it, or within 1 point of the step,
# whichever is larger (``band``); the swap is advised from 0.5% of the step
RELATIVE = 0.25
ABSOLUTE = 0.01
SMALL = ABSOLUTE / RELATIVE   # below this saving the 1 point is the larger
WORTH = 0.005

ADVICE = ("swap", "no action", "cannot tell")
# the fewest samples whose order statistics give a 95% interval of a median
MIN_SAMPLES = 6
# the calls of each rule whose values are kept to time it on
SETS = 3
# the default of audit(..., timing_budget=): seconds of timing rounds
BUDGET_S = 10.0


def band(saving: float, relative: float = RELATIVE,
         absolute: float = ABSOLUTE) -> float:
  """The tolerance's half-width around a saving (a share of the step):
  ``max(relative * |saving|, absolute)``."""
  return max(relative * abs(saving), absolute)


@dataclasses.dataclass(frozen=True)
class Advice:
  """What to do at a site, decided from a saving's interval (``advice``).

  ``kind``: one of ``ADVICE``; ``source``: ``"measured"``, ``"estimate"``
  or ``"none"`` (which interval decided); ``saving``: that interval
  (shares of the step, positive = the swap saves time), or ``None``.
  ``str(advice)`` is the words: ``"swap"``, ``"no action"`` or
  ``"cannot tell (±x points)"``, ``x`` the interval's half-width in
  points of the step."""
  kind: str
  source: str
  saving: Interval | None

  @property
  def points(self) -> float | None:
    """The interval's half-width, in points of the step (1 = 1%)."""
    return None if self.saving is None else 100 * self.saving.half_width

  def __str__(self) -> str:
    if self.kind != "cannot tell":
      return self.kind
    if self.saving is None:
      return "cannot tell (nothing timed)"
    if self.saving.samples and self.saving.level < TM.LEVEL - 1e-9:
      n = self.saving.samples
      return (f"cannot tell (only {n} round{'s' if n > 1 else ''} timed: "
              "too few for a 95% interval)")
    return f"cannot tell (±{self.points:.1f} points)"


def advice(estimate: Interval | None, measured: Interval | None = None, *,
           worth: float = WORTH, relative: float = RELATIVE,
           absolute: float = ABSOLUTE) -> Advice:
  """The advice at one site, from the 95% interval of its saving (shares of
  the step, positive = the swap saves time): ``measured`` (the site's
  saving measured in the step) where given, else ``estimate`` (its rules'
  timings; a point estimate is an ``Interval`` with ``low == high``).

  * ``"swap"``: the interval lies above 0 and its median is at least
    ``worth`` of the step;
  * ``"no action"``: the interval lies below ``worth`` (the saving, if
    any, is too small to act on; below 0 the swap costs time), or it holds
    0 and is no wider than the tolerance band around its median
    (``band``: ``max(relative * |median|, absolute)``);
  * ``"cannot tell"`` otherwise: the interval is wider than the
    tolerance (``str`` of the result gives its half-width in points); or
    there is no interval; or it is of too few samples to hold the saving
    with 95% probability (``Interval.level``; ``samples == 0`` marks a
    point estimate, the time model's, which decides by its value).

  Pure: the same intervals give the same advice (tested as a table in
  tests/test_audit_timing.py)."""
  iv, source = ((measured, "measured") if measured is not None else
                (estimate, "estimate") if estimate is not None else
                (None, "none"))
  if iv is None or (iv.samples and iv.level < TM.LEVEL - 1e-9):
    return Advice("cannot tell", source, iv)
  if iv.low > 0 and iv.median >= worth:
    return Advice("swap", source, iv)
  if iv.high < worth:
    return Advice("no action", source, iv)
  if iv.holds(0.0) and iv.half_width <= band(iv.median, relative, absolute):
    return Advice("no action", source, iv)
  return Advice("cannot tell", source, iv)


def agreement(estimate: float | None, measured: Interval, *,
              relative: float = RELATIVE, absolute: float = ABSOLUTE
              ) -> str | None:
  """An estimate of a saving (share of the step) against the 95% interval
  of its measurement: ``"agrees"`` within the tolerance band of the
  measured median (``band``), ``"disagrees"`` outside it, and
  ``"cannot tell"`` where the measurement's own interval is wider than
  that band (then no estimate could be told right or wrong); ``None``
  without an estimate."""
  if estimate is None:
    return None
  tol = band(measured.median, relative, absolute)
  if measured.half_width > tol:
    return "cannot tell"
  return "agrees" if abs(estimate - measured.median) <= tol else "disagrees"


def agrees(predicted: float | None, measured: float,
           spread: tuple[float, float] | None = None) -> bool | None:
  """Whether a predicted saving (share of the step) is within the
  tolerance of the measured one (``band``); ``None`` without a prediction.
  ``spread``: the measurement's 95% interval ``(low, high)``, where known:
  where it is wider than the band the measurement cannot tell, and the
  answer is ``None`` (``agreement`` gives the words)."""
  if predicted is None:
    return None
  if spread is None:
    return abs(predicted - measured) <= band(measured)
  lo, hi = min(spread), max(spread)
  verdict = agreement(predicted, Interval(measured, lo, hi, 0))
  return None if verdict == "cannot tell" else verdict == "agrees"


# -- the values the rules are timed on ------------------------------------------------

def made_up(tree, seed: int = 0):
  """``tree`` with each ``jax.ShapeDtypeStruct`` leaf replaced by values of
  a realistic scale (others unchanged): a floating array of two or more
  axes as LeCun's initialisation draws a weight, N(0, 1/fan-in) with its
  second-to-last axis the fan-in; other floating arrays N(0, 1); integers
  0 and booleans ``False``."""
  rng = np.random.default_rng(seed)

  def leaf(x):
    if not isinstance(x, jax.ShapeDtypeStruct):
      return x
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return jnp.zeros(x.shape, x.dtype)
    scale = 1.0 / np.sqrt(max(x.shape[-2], 1)) if len(x.shape) >= 2 else 1.0
    return jnp.asarray(rng.standard_normal(x.shape) * scale, x.dtype)
  return jax.tree.map(leaf, tree)


def has_made_up(tree) -> bool:
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


class Capture:
  """The values each rule of each site is given in one run of the step:
  ``kept[(site index, key)]``, up to ``sets`` lists of numpy arrays (one
  per input leaf), drawn uniformly from ``seen[(index, key)]`` calls
  (reservoir sampling: J. S. Vitter, "Random sampling with a reservoir",
  ACM TOMS 11(1), 1985). Keys: ``"primal"`` (what ``f`` and ``fwd`` are
  given: the dynamic arguments), ``"bwd"`` (residuals, then cotangents)
  and ``"cotangent"``."""

  def __init__(self, sets: int = SETS, seed: int = 0):
    self.sets, self._rng = sets, random.Random(seed)
    self.kept: dict = {}
    self.seen: dict = {}
    self.names: dict = {}
    self._lock = threading.Lock()

  def put(self, key, *leaves) -> None:
    values = [np.asarray(x) for x in leaves]
    with self._lock:
      n = self.seen[key] = self.seen.get(key, 0) + 1
      kept = self.kept.setdefault(key, [])
      if len(kept) < self.sets:
        kept.append(values)
      else:
        j = self._rng.randrange(n)
        if j < self.sets:
          kept[j] = values

  def _send(self, key, tree) -> None:
    primal = jx.cd.CustomVJPPrimal
    leaves = [x.value if isinstance(x, primal) else x for x in jax.tree.leaves(
        tree, is_leaf=lambda x: isinstance(x, primal))]
    if not all(isinstance(x, (jax.Array, np.ndarray, np.generic, int, float,
                              complex, bool)) or hasattr(x, "aval")
               for x in leaves):
      return   # a symbolic zero, an opaque object: nothing to time on
    jax.debug.callback(functools.partial(self.put, key), *leaves)

  def wrap(self, site, role, rule):
    """A ``_trace.Recorder`` wrap: ``rule`` that first sends what it is
    given to ``put``."""
    self.names[site.index] = site.name
    index, nondiff = site.index, site.nondiff_argnums

    @functools.wraps(rule)
    def sending(*args, **kwargs):
      if role in ("f", "fwd"):
        self._send((index, "primal"),
                   [a for i, a in enumerate(args) if i not in nondiff])
      elif role == "bwd":
        self._send((index, "bwd"), list(args[-2:]))
        self._send((index, "cotangent"), args[-1])
      elif role == "fwd_bwd":
        self._send((index, "cotangent"), args[-1])
        self._send((index, "primal"),
                   [a for i, a in enumerate(args[:-1]) if i not in nondiff])
      return rule(*args, **kwargs)
    return sending


def capture(fn, args, kwargs, concrete: tuple, sets: int = SETS) -> Capture:
  """One run of ``fn`` (traced on ``args``/``kwargs``, run on
  ``concrete``: its dynamic arguments as arrays) with every site as
  written and its rules sending their values (``Capture``)."""
  cap = Capture(sets)
  jitted = fn if hasattr(fn, "trace") and hasattr(fn, "lower") else jax.jit(fn)
  with TR.recording("as_written", {}, wrap=cap.wrap):
    compiled = jitted.trace(*args, **kwargs).lower().compile()
  jax.block_until_ready(compiled(*concrete[0], **concrete[1]))
  jax.effects_barrier()
  return cap


def _fit(values: list, avals) -> list | None:
  """``values`` (numpy arrays) as the rule's inputs ``avals``, or ``None``
  where they do not fit; a value with leading axes more (a batched call
  under ``vmap``) gives its first example."""
  if len(values) != len(avals):
    return None
  out = []
  for v, a in zip(values, avals):
    extra = v.ndim - len(a.shape)
    if extra < 0 or tuple(v.shape[extra:]) != tuple(a.shape):
      return None
    v = v[(0,) * extra]
    if np.dtype(v.dtype) != np.dtype(a.dtype):
      return None
    out.append(v)
  return out


_KEYS = {"f": ("primal",), "fwd": ("primal",), "bwd": ("bwd",),
         "fwd_bwd": ("cotangent", "primal")}


def rule_inputs(cap: Capture | None, index: int, role: str, closed,
                seed: int) -> tuple[list, str]:
  """The input sets to time ``role`` of site ``index`` on (each a list of
  arrays matching ``closed.in_avals``) and where they come from: the
  captured values, else made up (``made_up``) with the reason."""
  why = "no run of the step (nothing captured)"
  if cap is not None:
    parts = [cap.kept.get((index, k)) for k in _KEYS[role]]
    seen = min((cap.seen.get((index, k), 0) for k in _KEYS[role]), default=0)
    if all(parts):
      sets = [_fit([v for p in combo for v in p], closed.in_avals)
              for combo in zip(*parts)]
      sets = [s for s in sets if s is not None]
      if sets:
        return sets, (f"the step's values ({len(sets)} of {seen} calls)")
      why = "the captured values are not of the shapes traced"
    else:
      why = ("the step did not call it as written" if role != "fwd_bwd"
             else "a fused rule does not run as written")
  made = made_up([jax.ShapeDtypeStruct(a.shape, a.dtype)
                  for a in closed.in_avals], seed)
  return [list(made)], f"made up ({why})"


# -- the programs timed ----------------------------------------------------------------

@dataclasses.dataclass
class Program:
  """A looped program ready for ``_timing.rounds``: ``run()`` one sample
  of ``loop`` runs."""
  run: object
  loop: int
  inputs: str = ""


def looped(fn, sets: list) -> Program:
  """``fn`` looped on the input ``sets`` (``_timing.loop_program``) with
  its loop length chosen (``_timing.loop_length``)."""
  n = len(sets)
  args = ([jnp.asarray(x) for x in sets[0]] if n == 1 else
          [jnp.stack([jnp.asarray(s[i]) for s in sets])
           for i in range(len(sets[0]))])
  program = TM.loop_program(fn, n)
  flag = jnp.asarray(False)
  run_k = lambda k: program(jnp.int32(k), flag, *args)
  k, _ = TM.loop_length(run_k)
  k = -(-k // n) * n    # each set as often as the others
  count = jnp.int32(k)
  return Program(lambda: program(count, flag, *args), k)


def step_program(compiled, fn, args, kwargs, concrete: tuple) -> Program:
  """The as-written step (``compiled``, run on ``concrete``) as one
  program: run as compiled where one run lasts ``_timing.TARGET_S`` or
  more, else ``fn`` looped (``looped``) on the same values."""
  run = lambda: compiled(*concrete[0], **concrete[1])
  jax.block_until_ready(run())
  t = time.perf_counter()
  jax.block_until_ready(run())
  if time.perf_counter() - t >= TM.TARGET_S:
    return Program(run, 1)
  full = made_up((args, kwargs))
  leaves, tree = jax.tree.flatten(full)
  where = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array,
                                                             np.ndarray))]

  def step(*arrays):
    now = list(leaves)
    for i, x in zip(where, arrays):
      now[i] = x
    a, k = jax.tree.unflatten(tree, now)
    return fn(*a, **k)
  try:
    return looped(step, [[leaves[i] for i in where]])
  except Exception:   # noqa: BLE001  (then timed as compiled, one a sample)
    return Program(run, 1)


def time_programs(programs: dict, budget: float) -> tuple[dict, str, int]:
  """``({name: [seconds per run, one per round]}, stopped, rounds)``: the
  ``programs`` (``{name: Program}``) in interleaved rounds until each
  median's 95% interval is within ±5% of it, or ``budget`` seconds."""
  # enough rounds for simultaneous intervals of every median (the
  # step's saving combines them all: _timing.linear_interval)
  least = TM.samples_for(1.0 - (1.0 - TM.LEVEL) / max(len(programs), 1))
  samples, why = TM.rounds({k: p.run for k, p in programs.items()},
                           done=TM.narrow(0.05), budget_s=budget,
                           min_rounds=max(MIN_SAMPLES, least))
  per_run = {k: [x / programs[k].loop for x in v] for k, v in samples.items()}
  return per_run, why, len(next(iter(per_run.values()), []))


# -- the estimate -----------------------------------------------------------------------

def _runs(info: dict, config: str):
  runs = info["runs"].get(config)
  return None if runs is None else runs.get("compiled", runs["jaxpr"])


def coefficients(info: dict, roles) -> dict:
  """Seconds the swap saves at a site per second of each rule in
  ``roles``: its runs as written less its runs in its best configuration
  (as ``_model.site_seconds`` prices them: linear in the rules' times)."""
  def saved(t):
    price = lambda c: M.site_seconds(_runs(info, c), t, info["opaque"], 0,
                                      {"launch": 0.0})
    return price("as_written") - price(info["best_config"])
  zero = dict.fromkeys(roles, 0.0)
  base = saved(zero)
  return {role: saved({**zero, role: 1.0}) - base for role in roles}


def per_round(info: dict, samples: dict) -> list:
  """A site's saving (seconds per step) in each round: ``coefficients``
  times that round's rule times (paired: rules timed in one round share
  its load, which cancels in their difference)."""
  coef = coefficients(info, list(samples))
  n = min((len(v) for v in samples.values()), default=0)
  return [sum(c * samples[role][r] for role, c in coef.items())
          for r in range(n)]


def site_estimate(info: dict, timed: dict, samples: dict, step: list | None
                  ) -> dict:
  """A site's timed estimate. ``timed``: ``{role: {"seconds", ...} or
  {"error"}}`` (each rule's median seconds per run); ``samples``:
  ``{role: [seconds per run, one per round]}``; ``step``: the as-written
  step's seconds per round (``None`` where it was not timed).

  ``seconds``: per configuration, its compiled runs per rule times the
  rule's median (as ``_model.site_seconds`` prices them: a JAX-coded
  site's extra ``fwd`` runs as ``f``). ``seconds_saved``: the median of
  the per-round savings (``per_round``) and ``seconds_saved_interval``
  its 95% interval; ``share_of_step``: that over the step's median, and
  ``share_of_step_interval`` from the intervals of both, each at 97.5%
  (``_timing.linear_interval``; ``level``: the probability bound reached,
  less where the rounds were too few)."""
  own = {role: t["seconds"] for role, t in timed.items() if "seconds" in t}
  per = {c: M.site_seconds(_runs(info, c), own, info["opaque"], 0,
                           {"launch": 0.0})
         for c in info["runs"] if _runs(info, c) is not None}
  out = dict(rule_seconds=timed, seconds=per, seconds_saved=None,
             seconds_saved_interval=None, share_of_step=None,
             share_of_step_interval=None, rounds=0, level=None)
  if "as_written" not in per or info["best_config"] not in per:
    return out
  saved = per_round(info, samples)
  if not saved:   # no rule timed: the runs alone
    out["seconds_saved"] = per["as_written"] - per[info["best_config"]]
    return out
  iv = TM.median_interval(saved)
  out.update(seconds_saved=iv.median, seconds_saved_interval=[iv.low,
                                                              iv.high],
             rounds=iv.samples, level=iv.level)
  if step:
    share = TM.linear_interval([(1.0, saved)], step)
    out.update(share_of_step=share.median,
               share_of_step_interval=[share.low, share.high],
               level=share.level)
  return out


def interval_of(pair, median, samples: int = MIN_SAMPLES,
                level: float | None = None) -> Interval | None:
  """``[low, high]`` and a median as an ``Interval`` (``None`` where
  either is missing)."""
  if not pair or median is None:
    return None
  return Interval(median, pair[0], pair[1], samples,
                  TM.LEVEL if level is None else level)


def site_advice(info: dict) -> Advice:
  """The advice at a site (``advice``), from its measured saving in the
  step where there is one (``site["measured"]``: ``saving`` and
  ``interval``), else its timed estimate (``predicted.calibrated``), else
  the time model's point estimate (``predicted.share_of_step``)."""
  m = info.get("measured") or {}
  measured = (interval_of(m.get("interval"), m.get("saving"),
                          m.get("rounds", MIN_SAMPLES), m.get("level"))
              if "error" not in m else None)
  cal = (info.get("predicted") or {}).get("calibrated") or {}
  estimate = interval_of(cal.get("share_of_step_interval"),
                         cal.get("share_of_step"),
                         cal.get("rounds", MIN_SAMPLES), cal.get("level"))
  model = (info.get("predicted") or {}).get("share_of_step")
  if estimate is None and not cal and model is not None:
    estimate = Interval(model, model, model, 0)
  return advice(estimate, measured)


def attach(data: dict, builds: dict, advise, fn, args, kwargs,
           concrete: tuple, budget: float = BUDGET_S) -> None:
  """Adds the timed estimator to ``data`` (the audit's report):
  ``step_time`` (the as-written step, timed beside the rules), per site
  ``predicted["calibrated"]``, the step's ``calibrated`` (the sites'
  savings summed, as a share of the measured step) and, with
  ``measured``, the verdict of each estimate against the measurement.
  Each site's advice and suggestion are then given again
  (``advise(site) -> (kind, text)``). ``concrete``: the step's dynamic
  ``(args, kwargs)`` as arrays; ``budget``: seconds of timing rounds."""
  t0 = time.perf_counter()
  rules = next(iter(builds.values())).rules if builds else {}
  made = has_made_up((args, kwargs))
  try:
    cap, cap_error = capture(fn, args, kwargs, concrete), None
  except Exception as e:   # noqa: BLE001  (reported: then made-up values)
    cap, cap_error = None, f"{type(e).__name__}: {str(e)[:300]}"
  t_capture = time.perf_counter() - t0
  programs, timed = {}, {}
  for s in data["sites"]:
    r = rules.get(s["index"])
    # a fresh trace numbers the sites in the order they are called, as the
    # audit's did: a site whose name differs was not found again
    same = cap is not None and cap.names.get(s["index"]) == s["name"]
    for role, closed in (r.jaxprs if r else {}).items():
      key = (s["index"], role)
      try:
        sets, where = rule_inputs(cap if same else None, s["index"], role,
                                  closed, seed=s["index"])
        programs[key] = looped(jx.jaxpr_as_fun(closed), sets)
        programs[key].inputs = where
      except Exception as e:   # noqa: BLE001  (reported, not raised)
        timed[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
  if "as_written" in builds:
    programs["step"] = step_program(builds["as_written"].compiled, fn, args,
                                    kwargs, concrete)
  t_rounds = time.perf_counter()
  samples, stopped, n = (time_programs(programs, budget) if programs
                         else ({}, "converged", 0))
  t_rounds = time.perf_counter() - t_rounds
  for key, p in programs.items():
    if key != "step":
      iv = TM.median_interval(samples[key])
      timed[key] = dict(seconds=iv.median, low=iv.low, high=iv.high,
                        samples=iv.samples, loop=p.loop, inputs=p.inputs)
  step = samples.get("step")
  if step:
    iv = TM.median_interval(step)
    data["step_time"] = dict(median=iv.median, low=iv.low, high=iv.high,
                             samples=iv.samples, loop=programs["step"].loop)
  total = [0.0] * (len(step) if step else 0)
  for s in data["sites"]:
    mine = {role: t for (i, role), t in timed.items() if i == s["index"]}
    own = {role: samples[(s["index"], role)] for role in mine
           if (s["index"], role) in samples}
    est = site_estimate(s, mine, own, step)
    s["predicted"]["calibrated"] = est
    s["advice"], s["suggestion"] = advise(s)
    if own and est["seconds_saved"] is not None:
      total = [a + b for a, b in zip(total, per_round(s, own))]
  whole = TM.linear_interval([(1.0, total)], step) if step else None
  share = whole.median if whole else None
  inputs = ("made up (the step was given jax.ShapeDtypeStruct arguments: "
            "floating arrays of two or more axes N(0, 1/fan-in), others "
            "N(0, 1))" if made else "the step's arguments")
  data["calibrated"] = dict(
      source="each site's rules timed in a compiled loop on "
             + jax.default_backend() + ", on the values the step gives them",
      inputs=inputs, capture_error=cap_error,
      seconds_saved=(TM.median_interval(total).median if total
                     else sum(s["predicted"]["calibrated"]["seconds_saved"]
                              or 0.0 for s in data["sites"])),
      share_of_step=share,
      share_of_step_interval=[whole.low, whole.high] if whole else None,
      level=whole.level if whole else None,
      step_seconds=data["step_time"]["median"] if step else None,
      step_seconds_source=("measured: the as-written step on " + inputs)
      if step else "none (the as-written step did not compile)",
      rounds=n, stopped=stopped, budget_s=budget,
      capture_seconds=t_capture, rounds_seconds=t_rounds,
      timing_seconds=time.perf_counter() - t0)
  if data.get("measured"):
    verdict(data)


def _measured_interval(m: dict) -> Interval:
  """The step's measured saving and its 95% interval
  (``measured_saving_interval``, where the measurement gives one; else a
  point: the measurement's interquartile range is not an interval of its
  median)."""
  saving = 1.0 - m["paired_ratio"]
  pair = m.get("measured_saving_interval")
  if pair:
    return Interval(saving, min(pair), max(pair), m.get("rounds", 0))
  return Interval(saving, saving, saving, 0)


def verdict(data: dict) -> None:
  """Compares each estimate of the step's saving with the measured one
  (``data["measured"]``; ``agreement``: ``agrees``, ``disagrees``, or
  ``cannot tell`` where the measurement's interval is wider than the
  tolerance) and, where the leading estimate disagrees and a site has no
  saving measured of its own, gives that site's advice as "cannot tell"
  with the finding."""
  m = data["measured"]
  measured = _measured_interval(m)
  model = (1.0 - m["predicted_ratio"] if m.get("predicted_ratio") is not None
           else None)
  calibrated = data.get("calibrated", {}).get("share_of_step")
  checks = {"calibrated": agreement(calibrated, measured),
            "model": agreement(model, measured)}
  m["measured_saving"] = measured.median
  m["estimates"] = {"calibrated": calibrated, "model": model}
  m["agrees"] = checks
  lead = "calibrated" if calibrated is not None else "model"
  m["disagrees"] = checks[lead] == "disagrees"
  if m["disagrees"]:
    text = (f"cannot tell: the estimates ({_pct(calibrated)} from the rules' "
            f"timings, {_pct(model)} from the time model) disagree with the "
            f"step's measured saving ({_pct(measured.median)}) beyond the "
            f"tolerance (±{RELATIVE:.0%} of it or {ABSOLUTE:.0%} of the "
            "step, whichever is larger); measure each site's saving "
            "(measure=True) or the swap on your step")
    for s in data["sites"]:
      own = s.get("measured") or {}
      if own.get("interval") and "error" not in own:
        continue
      if not s["suggestion"].startswith(("none:", "no action: already")):
        s["suggestion"], s["advice"] = text, "cannot tell"
  said = {"agrees": "agrees", "disagrees": "DISAGREES",
          "cannot tell": (f"the measurement cannot tell "
                          f"(±{100 * measured.half_width:.1f} points)"),
          None: "no estimate"}[checks[lead]]
  m["summary"] += (f"; rule timings predict {_pct(calibrated)} saved, "
                   f"measured {_pct(measured.median)}; {said}")


def _pct(x) -> str:
  return "—" if x is None else f"{x:.1%}"
