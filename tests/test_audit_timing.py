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


def test_loop_program_runs_each_time_on_the_original_values():
  seen = []

  def host(x):
    seen.append(np.asarray(x).copy())
    return np.asarray(x) * 2

  def rule(x, n):
    y = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return y + 1, n

  x = jnp.arange(4.0)
  looped = T.loop_program(rule)
  jax.block_until_ready(looped(5, jnp.asarray(False), x, jnp.int32(3)))
  assert len(seen) == 5
  for s in seen:
    np.testing.assert_array_equal(s, np.arange(4.0))


def test_loop_program_is_not_hoisted_and_computes_every_output():
  # a pure JAX rule: XLA would hoist a loop-invariant body; the dependence
  # keeps k runs in the loop. And a consumer of one element of an
  # elementwise rule would compute that element alone: the outputs are
  # carried, so the loop's fusion computes all 4096 sines
  rule = lambda x: (jnp.sin(x) * 2.0,)
  program = T.loop_program(rule)
  hlo = program.lower(jnp.int32(8), jnp.asarray(False),
                      jnp.ones(4096)).compile().as_text()
  assert "while" in hlo
  fusions = {line.split("%", 1)[1].split(" ", 1)[0]: line
             for line in hlo.splitlines() if line.lstrip().startswith("%")
             and "fusion(" in line}
  sines = [name for name, line in fusions.items()
           if "f32[4096]" in line.split("=", 1)[1][:30]]
  assert sines, hlo
  assert "sine(" in hlo
  assert float(program(8, jnp.asarray(False), jnp.ones(16))) == 0.0


# -- the advice and the agreement, from intervals (issue 68 items 1 and 6) ------

from smartvjp.audit import _calibrate as K   # noqa: E402
from smartvjp.audit import _capture as C   # noqa: E402

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


# -- rules timed on the step's values, in loops, within a budget (item 1) --------

import time  # noqa: E402

import smartvjp  # noqa: E402


def _value_priced_site(per_unit=2e-3, seen=None):
  """A host kernel whose time grows with its inputs' size: it sleeps
  ``per_unit`` seconds per unit of mean |x| (libm's erf, cheapest near 0,
  is of this kind: "Why" 10); each mean |x| it is given goes to ``seen``."""
  def host(x):
    size = float(np.mean(np.abs(x)))
    if seen is not None:
      seen.append(size)
    time.sleep(per_unit * size)
    return np.asarray(np.sin(x), x.dtype)

  call = lambda x: jax.pure_callback(
      host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  site = jax.custom_vjp(call)
  site.defvjp(lambda x: (call(x), x), lambda x, g: (g * jnp.cos(x),))
  return site


def _step_of(site):
  return jax.grad(lambda x: jnp.sum(jax.checkpoint(site)(x)))


def test_a_rule_is_timed_on_the_values_the_step_gives_it():
  seen = []
  site = _value_priced_site(seen=seen)
  step = _step_of(site)
  x = jnp.full((16,), 5.0)         # mean |x| 5: the host sleeps 10 ms
  report = smartvjp.audit(step, x, calibrate=True, timing_budget=0.3,
                          configs=("as_written", "smartvjp"))
  fwd = report.sites[0]["predicted"]["calibrated"]["rule_seconds"]["fwd"]
  assert fwd["inputs"].startswith("the step's values")
  assert report.data["calibrated"]["inputs"] == "the step's arguments"
  # every run of the kernel, in the step and in the timing loops, was on
  # the step's values (the audit drew N(0, 0.1^2) before: mean |x| 0.08,
  # a 0.16 ms sleep), so it is priced at the 10 ms the step pays
  assert len(seen) > 4 and all(v == pytest.approx(5.0) for v in seen)
  assert fwd["low"] >= 10e-3 * 0.95
  # given only a ShapeDtypeStruct, it runs the step on made-up values and
  # says so
  made = smartvjp.audit(step, jax.ShapeDtypeStruct((16,), jnp.float32),
                        calibrate=True, timing_budget=0.3,
                        configs=("as_written", "smartvjp"))
  assert made.data["calibrated"]["inputs"].startswith("made up")
  assert "made up" in made.table()


def test_no_rule_doing_work_is_timed_at_zero_and_short_rules_are_looped(
    monkeypatch):
  # samples of 50 ms: a rule of microseconds loops many times even where
  # the machine's load stretches a dispatch to milliseconds
  monkeypatch.setattr(T, "TARGET_S", 0.05)
  f = jax.custom_vjp(lambda x: jnp.sin(x) * 2.0)
  f.defvjp(lambda x: (jnp.sin(x) * 2.0, jnp.cos(x)),
           lambda c, g: (2.0 * c * g,))
  report = smartvjp.audit(_step_of(f), jnp.linspace(0.0, 1.0, 4096),
                          calibrate=True, timing_budget=0.3,
                          configs=("as_written", "smartvjp"))
  timed = report.sites[0]["predicted"]["calibrated"]["rule_seconds"]
  assert set(timed) == {"f", "fwd", "bwd"}
  for role, t in timed.items():
    assert t["seconds"] > 0 and t["low"] > 0, (role, t)
    # a rule of microseconds runs many times a sample, so that a sample is
    # long against a dispatch (nothing subtracted); how long is the fake
    # clock's test below (test_loop_length_reaches_the_target)
    assert t["loop"] > 10, (role, t)
  st = report.data["step_time"]
  assert st["samples"] >= 1 and st["median"] > 0 and st["loop"] >= 1


def test_the_budget_is_honoured_and_recorded():
  site = _value_priced_site(per_unit=1e-3)
  t = time.perf_counter()
  report = smartvjp.audit(_step_of(site), jnp.full((8,), 2.0),
                          calibrate=True, timing_budget=0.0,
                          configs=("as_written", "smartvjp"))
  assert time.perf_counter() - t < 60
  cal = report.data["calibrated"]
  assert cal["stopped"] == "budget" and cal["rounds"] == 1
  assert cal["budget_s"] == 0.0
  s = report.sites[0]
  # one round is no 95% interval: the advice cannot tell, and says why
  assert s["predicted"]["calibrated"]["level"] < 0.95
  assert s["advice"] == "cannot tell"
  assert "only 1 round timed" in s["suggestion"]
  assert "budget 0 s" in report.table()
  with pytest.raises(ValueError, match="timing_budget"):
    smartvjp.audit(_step_of(site), jnp.ones(8), calibrate=True,
                   timing_budget=-1.0)


def test_capture_under_scan_checkpoint_and_vmap_keeps_real_calls():
  f = jax.custom_vjp(lambda x: jnp.sin(x))
  f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))

  def loss(x):
    y = jax.lax.scan(lambda c, _: (jax.checkpoint(f)(c), None), x, None,
                     length=5)[0]
    return jnp.sum(y)
  x = jnp.linspace(-1.0, 2.0, 6)
  cap = C.capture(jax.grad(loss), (x,), {}, ((x,), {}))
  layers = [np.asarray(x)]
  for _ in range(4):
    layers.append(np.sin(layers[-1]))
  assert cap.seen[(0, "primal")] == 10        # 5 forward, 5 rematerialized
  assert len(cap.kept[(0, "primal")]) == C.SETS
  for (v,) in cap.kept[(0, "primal")]:
    assert any(np.allclose(v, layer) for layer in layers)
  assert cap.seen[(0, "bwd")] == 5
  # under vmap a rule is given a batch: its first example fits the rule
  batched = C.capture(jax.vmap(jax.grad(loss)), (jnp.stack([x, 2 * x]),),
                      {}, ((jnp.stack([x, 2 * x]),), {}))
  (v,) = batched.kept[(0, "primal")][0]
  aval = jax.ShapeDtypeStruct((6,), jnp.float32)
  fit = C._fit([v], [aval])
  assert fit is not None and fit[0].shape == (6,)
  # a while loop (forward only: f runs each iteration)
  spin = lambda x: jax.lax.while_loop(lambda c: c[1] < 4,
                                      lambda c: (f(c[0]), c[1] + 1),
                                      (x, 0))[0]
  looped = C.capture(spin, (x,), {}, ((x,), {}))
  assert looped.seen[(0, "primal")] == 4
  # shard_map: each shard's values, as the rule sees them
  from jax.sharding import PartitionSpec as P
  shard_map = getattr(jax, "shard_map", None)
  if shard_map is None:
    from jax.experimental.shard_map import shard_map
  mesh = jax.make_mesh((1,), ("d",))
  sharded = jax.grad(lambda x: shard_map(loss, mesh=mesh, in_specs=P(),
                                         out_specs=P())(x))
  cap = C.capture(sharded, (x,), {}, ((x,), {}))
  assert cap.seen[(0, "primal")] == 10 and cap.seen[(0, "bwd")] == 5
  for (v,) in cap.kept[(0, "primal")]:
    assert any(np.allclose(v, layer) for layer in layers)


def test_an_interval_of_too_few_samples_says_so():
  assert T.median_interval([1.0]).level == 0.0
  assert T.median_interval([1.0, 2.0, 3.0]).level == pytest.approx(0.75)
  assert T.median_interval(list(range(6))).level >= 0.95
  assert T.median_interval(list(range(40))).level >= 0.95


def test_loop_length_reaches_the_target():
  clock = [0.0]

  def run(k):
    clock[0] += 1e-5 + 2e-6 * k      # 10 us a dispatch, 2 us a run
  k, took = T.loop_length(run, target_s=5e-3, clock=lambda: clock[0])
  assert took >= 5e-3 and 2e-6 * k >= 0.9 * (5e-3 - 1e-5)
  assert T.loop_length(run, target_s=1.0, max_loop=50,
                       clock=lambda: clock[0])[0] == 50


def test_loop_program_cycles_through_the_input_sets():
  seen = []

  def host(x):
    seen.append(float(np.asarray(x)[0]))
    return np.asarray(x)

  rule = lambda x: jax.pure_callback(
      host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  prog = T.loop_program(rule, sets=3)
  stacked = jnp.stack([jnp.full(4, v) for v in (1.0, 2.0, 3.0)])
  jax.block_until_ready(prog(jnp.int32(6), jnp.asarray(False), stacked))
  assert seen == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]


def test_median_interval_of_many_samples():
  # more rounds than a float's exponent holds 2**n for (a short step timed
  # for the whole budget): no OverflowError, and a narrow interval
  iv = T.median_interval(list(range(3001)))
  assert iv.median == 1500 and 1440 < iv.low < 1500 < iv.high < 1560


@pytest.mark.parametrize("n", [401, 1000, 3001])
def test_normal_approximation_ranks_cover(n):
  j, k = T._ranks(n, 0.95)
  cover = T.coverage(n, j)
  assert 0.95 <= cover < 0.97, cover   # conservative, never short
