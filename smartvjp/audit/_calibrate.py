"""The audit's measured estimator (``calibrate=True``, or with
``measure=True``): each site's rules timed alone on the device, at the
shapes and dtypes the step traced them with, and the site's saving
predicted from its runs saved times those times.

Where the time model (``_model``) prices a rule from XLA's cost analysis
and a table of peaks, this prices it from the clock: a host callback at
what the host takes, a kernel at what it takes, whatever XLA can see of
it. An operator-level benchmark beside an operator-level cost model, as
PyTorch's ``SACEstimator`` offers both. A rule timed alone pays one
dispatch that it does not pay inside the step; the time of a program that
takes the same inputs and does nothing is subtracted.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from smartvjp import _facade as jx
from smartvjp.audit import _model as M

# the tolerance the audit is held to (issue 63): a prediction agrees with a
# measured saving within a quarter of it, or, where the measured saving is
# below 1.2% of the step, within 0.3 percentage points of the step
RELATIVE = 0.25
SMALL, ABSOLUTE = 0.012, 0.003


def agrees(predicted: float | None, measured: float,
           spread: tuple[float, float] | None = None) -> bool | None:
  """Whether a predicted saving (share of the step, ``1 - ratio``) is
  within the tolerance of the measured one, or inside the measurement's
  own ``spread`` (the savings of its paired interquartile range, where
  the measurement cannot tell them apart); ``None`` without a
  prediction."""
  if predicted is None:
    return None
  if spread is not None and min(spread) <= predicted <= max(spread):
    return True
  if abs(measured) < SMALL:
    return abs(predicted - measured) <= ABSOLUTE
  return abs(predicted - measured) <= RELATIVE * abs(measured)


def _inputs(avals, seed: int) -> list:
  rng = np.random.default_rng(seed)
  out = []
  for a in avals:
    dtype = np.dtype(a.dtype) if a.dtype != jax.numpy.bfloat16 else None
    if dtype is not None and (np.issubdtype(dtype, np.integer)
                              or dtype == np.bool_):
      out.append(jax.numpy.zeros(a.shape, a.dtype))
    else:
      out.append(jax.numpy.asarray(rng.standard_normal(a.shape) * 0.1,
                                   a.dtype))
  return out


def median_seconds(programs: dict, warmup: int = 2, rounds: int = 21,
                   budget: float = 1.0, notch: bool = False) -> dict:
  """``{name: median wall seconds}`` of each ``(fn, args)`` in
  ``programs`` run to completion, after ``warmup`` runs of each: in
  rounds, each program once a round (interleaved, so that a change of the
  machine's load falls on all of them alike), at most ``rounds`` rounds,
  fewer once ``budget`` seconds are spent (at least 3). With
  ``notch=True``, ``{name: (median, notch)}``: ``notch`` the half-width
  of the median's 95% interval, 1.57 IQR / sqrt(runs) (the notch of a box
  plot: R. McGill, J. W. Tukey, W. A. Larsen, "Variations of box plots",
  The American Statistician 32(1), 1978)."""
  for fn, args in programs.values():
    for _ in range(warmup):
      jax.block_until_ready(fn(*args))
  times = {name: [] for name in programs}
  spent, n = 0.0, 0
  while n < rounds and (n < 3 or spent < budget):
    for name, (fn, args) in programs.items():
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t)
      spent += times[name][-1]
    n += 1
  if notch:
    return {name: (statistics.median(v), _notch(v))
            for name, v in times.items()}
  return {name: statistics.median(v) for name, v in times.items()}


def _notch(v: list) -> float:
  q1, _, q3 = statistics.quantiles(v, n=4)
  return 1.57 * (q3 - q1) / len(v) ** 0.5


def rule_seconds(jaxprs: dict, seed: int = 0) -> dict:
  """Each rule's (``{role: ClosedJaxpr}``) measured seconds per run, timed
  together (``median_seconds``): its median alone less that of an empty
  program with its inputs and outputs (``{"seconds", "raw", "empty"}``),
  or ``{"error"}`` for a rule that does not compile or run alone;
  ``notch``: the half-width of the 95% interval of its median
  (``median_seconds``)."""
  programs, out = {}, {}
  for i, (role, closed) in enumerate(jaxprs.items()):
    try:
      args = _inputs(closed.in_avals, seed + i)
      fn = jax.jit(jx.jaxpr_as_fun(closed))
      outs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.out_avals]
      empty = jax.jit(lambda *a, outs=outs: [
          jax.numpy.zeros(o.shape, o.dtype) for o in outs])
      jax.block_until_ready((fn(*args), empty(*args)))   # compiles
    except Exception as e:   # noqa: BLE001  (reported, not raised)
      out[role] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
      continue
    programs[role], programs[("empty", role)] = (fn, args), (empty, args)
  if programs:
    medians = median_seconds(programs, notch=True)
    for role in jaxprs:
      if role in programs:
        (raw, notch), (nothing, _) = medians[role], medians[("empty", role)]
        out[role] = {"seconds": max(raw - nothing, 0.0), "raw": raw,
                     "empty": nothing, "notch": notch}
  return out


def site_estimate(info: dict, timed: dict) -> dict:
  """A site's measured estimate: per configuration, its compiled runs per
  rule times the rule's measured seconds (as ``_model.site_seconds``
  prices them, a JAX-coded site's extra ``fwd`` runs as ``f``), and the
  saving as written less its best configuration. ``noise_seconds``: what
  the rules' timing cannot tell apart, each rule's ``notch`` times how many
  more or fewer runs of it the best configuration makes (``within_noise``:
  the saving is no larger: ``f`` and ``fwd`` running one kernel alike)."""
  own = {role: t["seconds"] for role, t in timed.items() if "seconds" in t}
  per = {}
  for config, runs in info["runs"].items():
    if runs is not None:
      per[config] = M.site_seconds(runs.get("compiled", runs["jaxpr"]), own,
                                   info["opaque"], 0, {"launch": 0.0})
  best = info["best_config"]
  saved = (per["as_written"] - per[best]
           if "as_written" in per and best in per else None)
  noise = None
  if saved is not None:
    a, b = (info["runs"][c].get("compiled", info["runs"][c]["jaxpr"])
            for c in ("as_written", best))
    noise = sum(abs(a.get(role, 0) - b.get(role, 0)) * t.get("notch", 0.0)
                for role, t in timed.items())
  return dict(rule_seconds=timed, seconds=per, seconds_saved=saved,
              noise_seconds=noise,
              within_noise=saved is not None and abs(saved) <= noise)


def attach(data: dict, builds: dict, advise) -> None:
  """Adds the measured estimator to ``data`` (the audit's report): per
  site ``predicted["calibrated"]``, the step's ``calibrated`` (the sites'
  savings summed, as a share of the step), and, with ``measured``, the
  verdict of each estimate against the measurement. Each site's advice is
  then given again from the leading estimate (``advise(site)``, the
  measured one where it exists), and only where the estimates agree with
  the measurement."""
  t0 = time.perf_counter()
  rules = next(iter(builds.values())).rules if builds else {}
  for s in data["sites"]:
    r = rules.get(s["index"])
    timed = rule_seconds(r.jaxprs if r else {}, seed=s["index"])
    s["predicted"]["calibrated"] = site_estimate(s, timed)
  step_seconds, source = _step_seconds(data)
  total = 0.0
  for s in data["sites"]:
    est = s["predicted"]["calibrated"]
    est["share_of_step"] = (est["seconds_saved"] / step_seconds
                            if est["seconds_saved"] is not None
                            and step_seconds else None)
    s["suggestion"] = advise(s)
    total += est["seconds_saved"] or 0.0
  share = total / step_seconds if step_seconds else None
  data["calibrated"] = dict(
      source="each site's rules timed alone on " + jax.default_backend(),
      seconds_saved=total, share_of_step=share,
      step_seconds=step_seconds,
      step_seconds_source=source,
      timing_seconds=time.perf_counter() - t0)
  if (data.get("measured") or {}).get("paired_ratio") is not None:
    verdict(data)


def _step_seconds(data: dict) -> tuple:
  """``(seconds, source)`` of the step as written that the sites' measured
  savings are shares of: measured where ``measure=True`` timed it; else
  the time model's, with its sites' modelled seconds replaced by their
  rules' timings (a model that prices a host callback at its launch alone
  would otherwise make a measured saving many times the step)."""
  step = (data.get("measured") or {}).get("seconds", {}).get("as_written")
  if step:
    return step["median"], "measured"
  total = ((data["step"].get("as_written") or {}).get("predicted_seconds")
           or {}).get("total")
  if total is None:
    return None, "time model"
  for s in data["sites"]:
    modelled = (s["predicted"].get("seconds") or {}).get("as_written")
    timed = s["predicted"]["calibrated"]["seconds"].get("as_written")
    if modelled is not None and timed is not None:
      total += timed - modelled
  return (max(total, 0.0) or None,
          "time model, its sites' seconds from their rules' timings")


def verdict(data: dict) -> None:
  """Compares each estimate with the measured step (``data["measured"]``)
  and, where none agrees within the tolerance, replaces each site's advice
  with that finding."""
  m = data["measured"]
  measured = 1.0 - m["paired_ratio"]
  model = (1.0 - m["predicted_ratio"] if m.get("predicted_ratio") is not None
           else None)
  calibrated = data.get("calibrated", {}).get("share_of_step")
  spread = tuple(1.0 - r for r in m["paired_ratio_iqr"])
  checks = {"calibrated": agrees(calibrated, measured, spread),
            "model": agrees(model, measured, spread)}
  m["measured_saving"] = measured
  m["estimates"] = {"calibrated": calibrated, "model": model}
  m["agrees"] = checks
  lead = "calibrated" if calibrated is not None else "model"
  m["disagrees"] = checks[lead] is False
  if m["disagrees"]:
    text = (f"no advice: the estimates ({_pct(calibrated)} from the rules' "
            f"timings, {_pct(model)} from the time model) disagree with the "
            f"step's measured saving ({_pct(measured)}) beyond the tolerance "
            f"(±{RELATIVE:.0%}, or {ABSOLUTE:.1%} of the step below "
            f"{SMALL:.1%}); measure the swap on your step")
    for s in data["sites"]:
      if not s["suggestion"].startswith("none:"):
        s["suggestion"] = text
  m["summary"] += (f"; rule timings predict {_pct(calibrated)} saved, "
                   f"measured {_pct(measured)}"
                   + ("; DISAGREES" if m["disagrees"] else "; agrees"))


def _pct(x) -> str:
  return "—" if x is None else f"{x:.1%}"
