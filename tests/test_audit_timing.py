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
