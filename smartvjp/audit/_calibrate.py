"""The audit's timed estimator's decisions (``calibrate=True``, implied by
``measure=True``; ``_capture`` runs it): the tolerance the audit is held
to, the advice from a saving's interval (``advice``), the agreement of an
estimate with a measurement (``agreement``), and each site's estimate from
its rules' timings (``site_estimate``): its runs saved times its rules'
times, as a share of the measured step, with a 95% interval.

Where the time model (``_model``) prices a rule from XLA's cost analysis
and a table of peaks, this prices it from the clock: a host callback at
what the host takes, a kernel at what it takes, whatever XLA can see of
it. An operator-level benchmark beside an operator-level cost model, as
PyTorch's ``SACEstimator`` offers both.

Per round of ``_capture``'s timing, each site's saving is its runs per
configuration times that round's rule times (``_model.site_seconds``:
linear in them, ``coefficients``) and its share is that over the same
round's step: the intervals are the order-statistics intervals of the
per-round savings and shares (rules timed in one round share its load,
which cancels in their difference and in the share). A rule's time is
what the clock gave: never clamped, never less an empty program's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from smartvjp.audit import _model as M
from smartvjp.audit import _timing as TM
from smartvjp.audit._timing import Interval

# the tolerance the audit is held to (issue 68): an estimate agrees with a
# measured saving within a quarter of it, or within 1 point of the step,
# whichever is larger (``band``); the swap is advised from 0.5% of the step
RELATIVE = 0.25
ABSOLUTE = 0.01
WORTH = 0.005

ADVICE = ("swap", "no action", "cannot tell")
# the fewest samples whose order statistics give a 95% interval of a median
MIN_SAMPLES = 6
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
  its 95% interval; ``share_of_step``: the median of each round's saving
  over the same round's step, and ``share_of_step_interval`` its 95%
  interval (``level``: the probability that it holds the median, less
  than 0.95 where the rounds were too few: ``_timing.median_interval``).
  Paired per round, the machine's load falls on the rules and the step
  alike."""
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
    share = share_interval(saved, step)
    out.update(share_of_step=share.median,
               share_of_step_interval=[share.low, share.high],
               level=share.level)
  return out


def share_interval(saved: list, step: list) -> Interval:
  """The median of ``saved[r] / step[r]`` (seconds saved and the step's
  seconds in round ``r``) and its 95% interval."""
  return TM.median_interval([a / b for a, b in zip(saved, step)])


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
  with the finding. Nothing where the step was not measured (its swapped
  build failed: ``measured["error"]``)."""
  m = data["measured"]
  if m.get("paired_ratio") is None:
    return
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
