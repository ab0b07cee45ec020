"""``measure=True``: each site's saving measured in the step.

The compiled step is run on the user's own arguments as written, with one
site swapped (one program per site), and with every site swapped, in
interleaved rounds (``_timing.rounds``: each program once a round, the order
rotated), until the 95% interval of every paired saving is inside the
tolerance band, or a time budget runs out. A saving is ``1 - r``, ``r`` the
median of the paired ratios (the swapped program's seconds over the
as-written one's in the same round; ``_timing.ratio_interval``), so a share
of the whole step's wall time: the same basis for a site and for the step,
on one device or on many (``shard_map``: every device runs its shard at
once, and the step's time is theirs).

A site is swapped to its ``best_config`` (``smartvjp_fused`` where it has a
``fwd_bwd``, else ``smartvjp``); the configuration with only some sites
swapped is ``_trace.swapped``, traced and compiled like the audit's others.
A configuration that does not trace, compile or run is recorded with its
error, not raised.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import jax
import numpy as np

from smartvjp import _facade as jx
from smartvjp.audit import _calibrate
from smartvjp.audit import _report
from smartvjp.audit import _timing
from smartvjp.audit import _trace as T

# a measured saving is narrow enough to stop within the tolerance band
# (_calibrate.band: a quarter of it or one point of the step, whichever is
# larger), or at most half a point
NARROW = 0.005
# the fewest rounds whose order statistics give a 95% interval of a median
MIN_ROUNDS = 6
ALL = "all"
# a sample of a short step is this many seconds of back-to-back runs
SAMPLE_S, MAX_LOOP = 0.01, 100


def settled(saving: _timing.Interval) -> bool:
  """Whether a saving's interval is narrow enough to stop timing."""
  if saving.samples < MIN_ROUNDS:
    return False
  return saving.half_width <= max(_calibrate.band(saving.median), NARROW)


def dynamic_arguments(fn, args, kwargs) -> tuple[tuple, dict]:
  """The arguments a compiled ``fn`` takes: without those ``jax.jit`` made
  static (``static_argnums``/``static_argnames``), which it was compiled
  for."""
  nums, names = jx.jit_static_arguments(fn)
  nums = {i % len(args) for i in nums if -len(args) <= i < len(args)}
  return (tuple(a for i, a in enumerate(args) if i not in nums),
          {k: v for k, v in kwargs.items() if k not in names})


def concrete(tree, seed: int = 0) -> tuple:
  """``(tree with each jax.ShapeDtypeStruct made an array, the pytree paths
  made up)``: floats drawn from N(0, 1) (the scale of normalized
  activations and initialized weights), integers and booleans zero (valid
  indices), PRNG keys split from one (JAX's default implementation);
  arrays as given."""
  rng = np.random.default_rng(seed)
  made: list = []

  def leaf(path, x):
    if not isinstance(x, jax.ShapeDtypeStruct):
      return x
    made.append(jax.tree_util.keystr(path) or "(the argument)")
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):   # keys: split
      n = math.prod(x.shape)
      keys = jax.random.split(jax.random.key(seed + len(made)), max(n, 1))
      return keys[:n].reshape(x.shape)
    dtype = np.dtype(x.dtype)
    if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
      return jax.numpy.zeros(x.shape, x.dtype)
    return jax.numpy.asarray(rng.standard_normal(x.shape), x.dtype)
  out = jax.tree_util.tree_map_with_path(leaf, tree)
  return out, made


def swap_choices(sites: list) -> dict:
  """``{site index: its best configuration}`` of the report's sites that
  can be swapped (not refused, not already ``smart_custom_vjp``)."""
  return {s["index"]: s["best_config"] for s in sites
          if s["refused"] is None and s["kind"] == "jax.custom_vjp"}


def candidate(data: dict) -> str:
  """The configuration with every site swapped: the report's candidate, or
  where it did not build, the one that failed."""
  return data["predicted"].get("candidate") or (
      "smartvjp_fused" if "smartvjp_fused" in data["errors"] else "smartvjp")


def plan(data: dict, builds: dict) -> tuple[dict, dict, dict]:
  """``({program: configuration to build}, {program: Build already built},
  {program: error})``: ``as_written``, ``ALL`` (every site swapped: the
  report's ``candidate``, built already, or its error) and a program per
  swappable site (``("site", index)``), whose configuration swaps it
  alone. With one swappable site its program is ``ALL``'s."""
  choices = swap_choices(data["sites"])
  cand = candidate(data)
  ready, todo, errors = {"as_written": builds["as_written"]}, {}, {}
  if cand in builds:
    ready[ALL] = builds[cand]
  else:
    errors[ALL] = data["errors"].get(cand, f"{cand} was not built")
  for i, best in sorted(choices.items()):
    key = ("site", i)
    if len(choices) > 1:
      todo[key] = T.swapped({i: best})
    elif ALL in ready:
      ready[key] = ready[ALL]
    else:
      errors[key] = errors[ALL]
  return todo, ready, errors


def _error(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).strip()[:500]}"


def _saving(ratio: _timing.Interval) -> _timing.Interval:
  return _timing.Interval(1.0 - ratio.median, 1.0 - ratio.high,
                          1.0 - ratio.low, ratio.samples)


def measure(builds: dict, data: dict, args, kwargs, *, fn,
            compile_configs: Callable, budget_s: float = _calibrate.BUDGET_S,
            min_rounds: int = MIN_ROUNDS) -> dict:
  """Measures the step's and each site's saving (see the module).

  Args:
    builds: ``{configuration: _analysis.Build}`` of the audit (compiled);
      ``as_written`` must be among them.
    data: the report (``_analysis.analyse``); each site that was timed
      gets ``site["measured"]``: ``{"saving", "interval", "ratio",
      "rounds", "stopped"}`` or ``{"error"}``.
    args, kwargs: the step's arguments (arrays, or ``ShapeDtypeStruct``
      filled by ``concrete``).
    fn: the step (for its ``jax.jit`` static arguments).
    compile_configs: ``configs -> ({config: Build}, {config: error})``,
      ``_analysis.build_all`` bound to the step and its sites (traced in
      turn, compiled in parallel threads).
    budget_s: seconds of timing rounds at most (the first round always
      completes).
    min_rounds: rounds before the intervals are judged.

  Returns:
    ``data["measured"]``: the step's A/B (``docs/audit.md``, ``measured``);
    ``measure_s``: the seconds it took (compiles, warm-up, rounds);
    ``error`` where the step as written did not run.
  """
  t0 = time.perf_counter()
  cand = candidate(data)
  if "as_written" not in builds:
    error = ("the step as written did not build: "
             + data["errors"].get("as_written", "?"))
    return dict(candidate=cand, error=error, summary=error, pairs=0,
                rounds=0, stopped=None, measure_s=time.perf_counter() - t0)
  ready, errors = _compile(data, builds, compile_configs)
  compile_s = time.perf_counter() - t0
  dyn_args, dyn_kwargs = dynamic_arguments(fn, args, kwargs)
  dyn_args, made_args = concrete(dyn_args, 0)
  dyn_kwargs, made_kwargs = concrete(dyn_kwargs, 1)
  made = made_args + [f"{k}" for k in made_kwargs]
  programs, alias = _warm(ready, errors, dyn_args, dyn_kwargs)
  inputs = ("the step's own arguments" if not made else
            "made up for the ShapeDtypeStruct argument(s) "
            + ", ".join(made) + ": N(0, 1) floats, zero integers")
  out = dict(candidate=cand, inputs=inputs, budget_s=budget_s,
             errors={_key_text(k): v for k, v in errors.items()})
  if "as_written" not in programs:
    error = "the step as written did not run: " + errors.get("as_written", "?")
    out.update(error=error, summary=error, pairs=0, rounds=0,
               stopped=None, measure_s=time.perf_counter() - t0)
    _site_results(data, {}, errors, 0)
    return out
  swapped = [k for k in alias if k != "as_written" and alias[k] in programs]
  loop = loop_count(programs["as_written"])
  programs = {k: _repeated(p, loop) for k, p in programs.items()}

  def savings(samples: dict) -> dict:
    base = samples["as_written"]
    return {k: _saving(_timing.ratio_interval(samples[alias[k]], base))
            for k in swapped}

  def done(samples: dict) -> bool:
    return all(settled(s) for s in savings(samples).values())

  t1 = time.perf_counter()
  samples, why = _timing.rounds(programs, done=done, budget_s=budget_s,
                                min_rounds=min_rounds)
  timing_s = time.perf_counter() - t1
  n = len(samples["as_written"])
  stopped = "converged" if why == "converged" else "budget"
  by_key = savings(samples)
  _site_results(data, by_key, errors, n)
  out.update(pairs=n, rounds=n, stopped=stopped, loop=loop,
             seconds={c: _seconds(samples[alias[k]], loop) for c, k in (
                 ("as_written", "as_written"), (cand, ALL)) if k in by_key
                 or k == "as_written"})
  summary = _step_result(out, by_key, samples, alias, errors, cand, n)
  pred = data["predicted"].get("predicted_ratio")
  out.update(
      predicted_ratio=pred,
      predicted_bytes_accessed_ratio=data["predicted"].get(
          "bytes_accessed_ratio"),
      disagrees=None,
      summary=summary + "; predicted (roofline) "
      + ("—" if pred is None else f"{pred:.3f}")
      + f"; {stopped} after {n} rounds, {timing_s:.1f} s"
      + ("" if not made else "; on made-up inputs (ShapeDtypeStruct "
         "arguments)"),
      timing_s=timing_s, compile_s=compile_s,
      measure_s=time.perf_counter() - t0)
  return out


def _compile(data: dict, builds: dict, compile_configs: Callable
             ) -> tuple[dict, dict]:
  """``({program: Build}, {program: error})``: ``plan``'s builds, the
  missing ones compiled (``compile_configs``)."""
  todo, ready, errors = plan(data, builds)
  distinct = sorted(set(todo.values()))
  built, build_errors = (compile_configs(tuple(distinct)) if distinct
                         else ({}, {}))
  for key, config in todo.items():
    if config in built:
      ready[key] = built[config]
    else:
      errors[key] = build_errors.get(config, "did not build")
  return ready, errors


def _warm(ready: dict, errors: dict, dyn_args, dyn_kwargs
          ) -> tuple[dict, dict]:
  """``({program: callable}, {program: the program timed for it})``: one
  callable per distinct build, each run once (a run that raises is
  recorded in ``errors``, and the program left out)."""
  programs, alias, first = {}, {}, {}
  for key, b in ready.items():
    if id(b) in first:
      alias[key] = first[id(b)]
      if alias[key] in errors:
        errors[key] = errors[alias[key]]
      continue
    first[id(b)] = alias[key] = key
    program = (lambda c=b.compiled: c(*dyn_args, **dyn_kwargs))
    try:
      jax.block_until_ready(program())   # the warm-up run
    except Exception as e:   # noqa: BLE001  (recorded, not raised)
      errors[key] = _error(e)
      continue
    programs[key] = program
  return programs, alias


def _step_result(out: dict, by_key: dict, samples: dict, alias: dict,
                 errors: dict, cand: str, n: int) -> str:
  """The all-swapped step's keys of ``out``; returns its summary."""
  if ALL not in by_key:
    out.update(paired_ratio=None, paired_ratio_iqr=None,
               measured_saving=None, measured_saving_interval=None,
               error=f"{cand}: {errors.get(ALL, '?')}")
    return f"{cand} did not run: {errors.get(ALL, '?')}"
  ratios = [b / a for a, b in zip(samples["as_written"],
                                  samples[alias[ALL]])]
  step = by_key[ALL]
  lo, hi = (float(np.percentile(ratios, q)) for q in (25, 75))
  out.update(paired_ratio=1.0 - step.median, paired_ratio_iqr=[lo, hi],
             measured_saving=step.median,
             measured_saving_interval=[step.low, step.high])
  return (f"{cand} / jax.custom_vjp = {1.0 - step.median:.3f} (paired, "
          f"median of {n}; its 95% interval {1.0 - step.high:.3f}-"
          f"{1.0 - step.low:.3f})")


def loop_count(program: Callable) -> int:
  """Runs of a program per sample: enough that a sample lasts ``SAMPLE_S``
  (dispatch then does not dominate a short step: the runs are dispatched
  back to back, as a training loop dispatches its steps), at most
  ``MAX_LOOP``; searched as the rules' loops are (``_timing.loop_length``,
  one try per guess)."""
  k, _ = _timing.loop_length(lambda k: _repeated(program, k)(), SAMPLE_S,
                             MAX_LOOP, tries=1)
  return k


def _repeated(program: Callable, k: int) -> Callable:
  if k == 1:
    return program
  return lambda: [program() for _ in range(k)]


def _key_text(key) -> str:
  return f"site {key[1]}" if isinstance(key, tuple) else str(key)


def _seconds(xs: list, loop: int) -> dict:
  xs = [x / loop for x in xs]
  iv = _timing.median_interval(xs)
  return dict(median=iv.median, min=float(min(xs)), max=float(max(xs)),
              low=iv.low, high=iv.high)


def _site_results(data: dict, by_key: dict, errors: dict, n: int) -> None:
  for s in data["sites"]:
    key = ("site", s["index"])
    if key in by_key:
      iv = by_key[key]
      s["measured"] = dict(
          saving=iv.median, interval=[iv.low, iv.high],
          ratio=1.0 - iv.median, rounds=n,
          stopped="converged" if settled(iv) else "budget")
    elif key in errors:
      s["measured"] = {"error": errors[key]}


def interval(site: dict) -> _timing.Interval | None:
  """A site's measured saving as an ``Interval`` (``None`` where it was not
  measured)."""
  m = site.get("measured")
  if not m or "saving" not in m:
    return None
  return _timing.Interval(m["saving"], m["interval"][0], m["interval"][1],
                          m["rounds"])


def suggestion(site: dict) -> str:
  """The site's suggestion, following its measured saving where it was
  measured (else the estimate's suggestion, ``site["suggestion"]``, as
  it is)."""
  m, current = site.get("measured"), site["suggestion"]
  if not m or "error" in m:
    return current
  text = "measured in the step: " + _report.measured_text(m)
  kind = site["advice"]
  if kind == "swap":
    how = (current.removeprefix("swap: ") if current.startswith("swap: ")
           else f"decorate {site['name']} with smartvjp.smart_custom_vjp, "
           "or report.apply(step)")
    return f"swap ({text}): {how}"
  if kind == "no action":
    return f"no action ({text})"
  points = (m["interval"][1] - m["interval"][0]) / 2 * 100
  return (f"cannot tell (±{points:.1f} points; {text}): a larger "
          "timing_budget= narrows the interval")
