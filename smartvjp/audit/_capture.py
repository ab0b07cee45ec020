"""The audit's timed estimator, run (``calibrate=True``, implied by
``measure=True``): each site's rules timed on the values the step gives
them, the as-written step timed beside them, and the estimates and advice
of ``_calibrate`` attached to the report (``attach``). Timed as benchmark
harnesses (pyperf, Criterion.rs, ``triton.testing.do_bench``) time: many
runs per sample, repeated until the estimate is stable, reported as an
interval.

1. **Capture** (``capture``): the step is traced once more with every site
   as written, each rule wrapped so that a ``jax.debug.callback`` sends
   the values it is given to the host, and run once on the user's
   arguments (where they are ``jax.ShapeDtypeStruct``, on made-up values,
   ``_calibrate.made_up``; the report says which). A debug callback is an
   effect that dead-code elimination keeps and these transformations
   allow (tests/test_audit_timing.py runs it under each): it runs under
   ``jit``, ``scan`` and ``while`` (each iteration), ``jax.checkpoint``
   (and again in the rematerialized region), ``vmap`` (batched values: the
   first example is kept) and ``shard_map`` (one shard's values, as the
   rule sees them); returning the values as extra outputs instead would
   need a twin of every transformation around the site. Up to ``SETS``
   calls of each rule (one where a call's values exceed ``BIG`` bytes)
   are kept, drawn uniformly from all its calls (reservoir sampling),
   so that a rule called in every layer of a scan is timed on several
   layers' values. This is the audit's one extra trace, compile and run of
   the step: effects in the step (an ``io_callback``) happen once more.
2. **Loop** (``_timing.loop_program``): each rule runs ``K`` times in one
   compiled loop, on its kept values in turn, each run's inputs depending
   on the previous run's outputs; ``K`` makes a sample at least
   ``_timing.TARGET_S`` long (``_timing.loop_length``), so that the
   dispatch of a sample is small against it and nothing is subtracted.
   The as-written step is timed beside them, looped the same way where one
   run is shorter than the target.
3. **Rounds** (``_timing.rounds``): every program once a round, the order
   rotated, until each one's median has a 95% interval within ±5% of it
   (``_timing.narrow``) or ``budget`` seconds pass (``"stopped"``:
   ``"converged"`` or ``"budget"``).
4. **Estimate** (``_calibrate.site_estimate``) and advice.
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
from smartvjp.audit import _calibrate as K
from smartvjp.audit import _timing as TM
from smartvjp.audit import _trace as TR

# the calls of each rule whose values are kept to time it on; one where a
# call's values are larger than BIG bytes (they are kept on the host, and
# stacked on the device to be timed)
SETS = 3
BIG = 64 << 20


class StepValues:
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
    sets = 1 if sum(v.nbytes for v in values) > BIG else self.sets
    with self._lock:
      n = self.seen[key] = self.seen.get(key, 0) + 1
      kept = self.kept.setdefault(key, [])
      if len(kept) < sets:
        kept.append(values)
      else:
        j = self._rng.randrange(n)
        if j < sets:
          kept[j % len(kept)] = values

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


def capture(fn, args, kwargs, concrete: tuple, sets: int = SETS) -> StepValues:
  """One run of ``fn`` (traced on ``args``/``kwargs``, run on
  ``concrete``: its dynamic arguments as arrays) with every site as
  written and its rules sending their values (``StepValues``)."""
  cap = StepValues(sets)
  jitted = fn if jx.is_jit_function(fn) else jax.jit(fn)
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


def rule_inputs(cap: StepValues | None, index: int, role: str, closed,
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
  made = K.made_up([jax.ShapeDtypeStruct(a.shape, a.dtype)
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
  k, _ = TM.loop_length(run_k, TM.TARGET_S)
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
  full = K.made_up((args, kwargs))
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
  samples, why = TM.rounds({k: p.run for k, p in programs.items()},
                           done=TM.narrow(0.05), budget_s=budget,
                           min_rounds=K.MIN_SAMPLES)
  per_run = {k: [x / programs[k].loop for x in v] for k, v in samples.items()}
  return per_run, why, len(next(iter(per_run.values()), []))



# -- the estimator, run ------------------------------------------------------------------

def attach(data: dict, builds: dict, advise, fn, args, kwargs,
           concrete: tuple, budget: float = K.BUDGET_S) -> None:
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
  made = K.has_made_up((args, kwargs))
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
    est = K.site_estimate(s, mine, own, step)
    s["predicted"]["calibrated"] = est
    s["advice"], s["suggestion"] = advise(s)
    if own and est["seconds_saved"] is not None:
      total = [a + b for a, b in zip(total, K.per_round(s, own))]
  whole = K.share_interval(total, step) if step else None
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
    K.verdict(data)
