"""smartvjp/audit/_timing.py: the interval of a median, the stopping rule,
interleaved rounds, and a rule repeated in one compiled loop."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smartvjp.audit import _timing as T


def _coverage_by_enumeration(n, j, k):
  # P(x(j) <= median <= x(k)) = P(j <= B <= k - 1) for 0-based ranks j, k
  return sum(math.comb(n, i) for i in range(j + 1, k + 1)) / 2.0 ** n


@pytest.mark.parametrize("n", [6, 9, 20, 40, 101])
def test_median_interval_ranks_have_the_level(n):
  j, k = T._ranks(n, 0.95)
  assert _coverage_by_enumeration(n, j, k) >= 0.95
  # and it is the narrowest symmetric one: one rank in, it falls short
  assert _coverage_by_enumeration(n, j + 1, k - 1) < 0.95


def test_median_interval_values():
  xs = list(range(1, 41))          # 1..40: median 20.5
  iv = T.median_interval(xs)
  assert iv.median == 20.5 and iv.samples == 40
  assert iv.low == 14 and iv.high == 27      # ranks 13 and 26 (0-based)
  assert iv.holds(20.5) and not iv.holds(30)
  # too few samples for 95%: the range
  iv = T.median_interval([3.0, 1.0, 2.0])
  assert (iv.low, iv.median, iv.high) == (1.0, 2.0, 3.0)
  with pytest.raises(ValueError):
    T.median_interval([])


def test_median_interval_covers_in_simulation():
  rng = np.random.default_rng(0)
  hits = 0
  for _ in range(2000):
    xs = rng.lognormal(0.0, 1.0, size=25)   # skewed; true median 1.0
    hits += T.median_interval(xs).holds(1.0)
  assert hits / 2000 >= 0.94


def test_ratio_interval_pairs_samples():
  iv = T.ratio_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
  assert iv.median == iv.low == iv.high == 2.0


def test_rounds_interleaves_rotates_and_stops():
  calls = []
  progs = {n: (lambda n=n: calls.append(n)) for n in "abc"}
  ticks = itertools.count()
  samples, why = T.rounds(progs, done=lambda s: len(s["a"]) >= 7,
                          budget_s=1e9, min_rounds=3,
                          clock=lambda: float(next(ticks)))
  assert why == "converged" and all(len(v) == 7 for v in samples.values())
  assert calls[:9] == list("abcbcacab")   # rotated each round
  # the budget: the first round always completes, then it stops
  samples, why = T.rounds(progs, done=lambda s: False, budget_s=0.0,
                          clock=lambda: float(next(ticks)))
  assert why == "budget" and all(len(v) == 1 for v in samples.values())
  samples, why = T.rounds(progs, done=lambda s: False, budget_s=1e9,
                          max_rounds=4, min_rounds=1)
  assert why == "max_rounds" and len(samples["b"]) == 4


def test_narrow():
  assert T.narrow(0.05)({"a": [1.0] * 10})
  assert not T.narrow(0.05)({"a": [1.0, 2.0] * 10})
  assert not T.narrow(0.05)({"a": [1.0]})


def test_repeat_in_loop_runs_each_time_on_the_original_values():
  seen = []

  def host(x):
    seen.append(np.asarray(x).copy())
    return np.asarray(x) * 2

  def rule(x, n):
    y = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return y + 1, n

  x = jnp.arange(4.0)
  looped = T.repeat_in_loop(rule, 5)
  jax.block_until_ready(looped(jnp.asarray(False), x, jnp.int32(3)))
  assert len(seen) == 5
  for s in seen:
    np.testing.assert_array_equal(s, np.arange(4.0))


def test_repeat_in_loop_is_not_hoisted():
  # a pure JAX rule: XLA would hoist a loop-invariant body; the dependence
  # keeps k runs in the loop (the compiled loop has the body's sine)
  rule = lambda x: (jnp.sin(x),)
  looped = T.repeat_in_loop(rule, 8)
  hlo = looped.lower(jnp.asarray(False), jnp.ones(16)).compile().as_text()
  assert "while" in hlo
  assert "sine" in hlo
  assert float(looped(jnp.asarray(False), jnp.ones(16))) == 0.0


# -- the advice and the agreement, from intervals (issue 68 items 1 and 6) ------

from smartvjp.audit import _calibrate as K   # noqa: E402

I = lambda m, lo, hi: T.Interval(m, lo, hi, 20)


@pytest.mark.parametrize("estimate,measured,kind,text", [
    (I(0.10, 0.08, 0.12), None, "swap", "swap"),
    # the measurement leads where there is one
    (I(0.10, 0.08, 0.12), I(0.001, -0.002, 0.004), "no action", "no action"),
    (None, I(0.10, 0.08, 0.12), "swap", "swap"),
    # above 0 but below 0.5% of the step: not worth a change
    (I(0.003, 0.001, 0.0045), None, "no action", "no action"),
    # holds 0, narrower than the band (1 point): no action
    (I(0.002, -0.006, 0.009), None, "no action", "no action"),
    # a predicted slowdown: no action, never "within noise"
    (I(-0.079, -0.09, -0.07), None, "no action", "no action"),
    # holds 0, wider than the band: cannot tell, with its half-width
    (I(0.02, -0.05, 0.09), None, "cannot tell", "cannot tell (±7.0 points)"),
    # above 0 at its median but the interval reaches below: cannot tell
    (I(0.06, -0.01, 0.20), None, "cannot tell", "cannot tell (±10.5 points)"),
    # nothing timed
    (None, None, "cannot tell", "cannot tell (nothing timed)"),
    # a point (the time model): swap or no action by its value
    (I(0.02, 0.02, 0.02), None, "swap", "swap"),
    (I(0.0, 0.0, 0.0), None, "no action", "no action"),
])
def test_advice_table(estimate, measured, kind, text):
  a = K.advice(estimate, measured)
  assert a.kind == kind and a.kind in K.ADVICE
  assert str(a) == text
  assert a.source == ("measured" if measured is not None else
                      "estimate" if estimate is not None else "none")


@pytest.mark.parametrize("estimate,measured,want", [
    (0.10, I(0.12, 0.11, 0.13), "agrees"),          # within a quarter
    (0.05, I(0.12, 0.11, 0.13), "disagrees"),
    (0.20, I(0.12, 0.11, 0.13), "disagrees"),
    (0.004, I(0.006, 0.004, 0.008), "agrees"),      # within 1 point
    (0.0, I(0.006, 0.004, 0.008), "agrees"),
    (0.0, I(0.11, 0.10, 0.12), "disagrees"),        # the model's 0.0%
    # the measurement's interval is wider than the band: it cannot tell
    (0.0, I(0.11, -0.05, 0.31), "cannot tell"),
    (0.243, I(0.085, 0.02, 0.15), "cannot tell"),
    (None, I(0.1, 0.09, 0.11), None),
])
def test_agreement_table(estimate, measured, want):
  assert K.agreement(estimate, measured) == want


def test_the_band_is_a_quarter_or_a_point():
  assert K.band(0.40) == pytest.approx(0.10)
  assert K.band(-0.40) == pytest.approx(0.10)
  assert K.band(0.02) == 0.01
