"""``measure=True``: each site's saving measured in the step, and
``Audit.apply``, the step with only the advised sites swapped.

Two sites in one checkpointed step, each a host-callback kernel counted in
``kernels.COUNTS``: ``slow``, whose ``fwd`` sleeps (the forward pass's
``fwd`` is dropped and run again under remat as written; the swap runs the
fast ``f`` in its place: worth about half the step), and ``even``, whose
rules take no time (worth nothing). Shapes and budgets are tiny; the only
timing claims are ones a 2-core machine shared with other work keeps (a
sleep of ``SLEEP`` seconds against rules of microseconds).
"""

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartvjp
from smartvjp.audit import _calibrate
from smartvjp.audit import _measure, _timing, _trace

import kernels

SLEEP = 0.02
X = jnp.linspace(0.1, 1.0, 8)


def _site(prefix, sleep):
  def slow(x):
    time.sleep(sleep)
    return np.sin(x), np.cos(x)

  def f(x):
    (y,) = kernels.kernel(prefix + "f", lambda x: (np.sin(x),), [x], x)
    return y

  def fwd(x):
    y, c = kernels.kernel(prefix + "fwd", slow, [x, x], x)
    return y, c

  def bwd(c, g):
    (dx,) = kernels.kernel(prefix + "bwd", lambda c, g: (c * g,), [g], c, g)
    return (dx,)

  site = jax.custom_vjp(f)
  site.defvjp(fwd, bwd)
  return site


SLOW = _site("slow.", SLEEP)
EVEN = _site("even.", 0.0)


def _loss(x):
  return jnp.sum(jax.checkpoint(lambda x: EVEN(SLOW(x)))(x))


STEP = jax.value_and_grad(_loss)


@pytest.fixture(scope="module")
def report():
  return smartvjp.audit(STEP, X, measure=True, timing_budget=3.0,
                        configs=("as_written", "smartvjp"))


def _sites(report):
  """(SLOW's site, EVEN's): found in the order the step calls them."""
  by_index = {s["index"]: s for s in report.sites}
  return by_index[0], by_index[1]


def test_each_site_measured_and_ordered(report):
  slow, even = _sites(report)
  for s in (slow, even):
    m = s["measured"]
    assert set(m) == {"saving", "interval", "ratio", "rounds", "stopped"}
    lo, hi = m["interval"]
    assert lo <= m["saving"] <= hi
    assert m["ratio"] == pytest.approx(1 - m["saving"])
    assert m["stopped"] in ("converged", "budget") and m["rounds"] >= 1
  # the swap runs SLOW's sleeping fwd once a step where it ran twice:
  # about half the step; EVEN's swap saves nothing of note
  # (loose bounds: a 2-core machine shared with other work wakes a sleep
  # late by milliseconds)
  assert slow["measured"]["saving"] > 0.2, slow["measured"]
  assert slow["measured"]["interval"][0] > 0.05, slow["measured"]
  assert abs(even["measured"]["saving"]) < 0.2, even["measured"]
  assert slow["measured"]["interval"][0] > even["measured"]["saving"]
  assert slow["advice"] == "swap"


def test_the_step_measured_on_the_same_basis(report):
  m = report.measured
  slow, even = _sites(report)
  for key in ("pairs", "candidate", "seconds", "paired_ratio",
              "paired_ratio_iqr", "measured_saving", "summary",
              "measured_saving_interval", "rounds", "stopped", "measure_s"):
    assert key in m, key
  assert m["inputs"] == "the step's own arguments"
  assert m["stopped"] in ("converged", "budget")
  assert m["measured_saving"] == pytest.approx(1 - m["paired_ratio"])
  lo, hi = m["measured_saving_interval"]
  assert lo <= m["measured_saving"] <= hi
  # the whole swap saves what its sites save: the step's interval meets
  # the sum of theirs
  (a, b), (c, d) = slow["measured"]["interval"], even["measured"]["interval"]
  assert lo <= b + d and a + c <= hi, (m, slow, even)
  assert set(m["seconds"]) == {"as_written", "smartvjp"}
  assert m["seconds"]["as_written"]["median"] > 2 * SLEEP   # per run
  assert m["loop"] == 1   # a run is longer than a sample needs
  assert m["measure_s"] >= m["timing_s"] > 0
  assert "paired" in report.table()


def test_the_budget_is_honoured():
  t = time.perf_counter()
  report = smartvjp.audit(STEP, X, measure=True, timing_budget=0.2,
                          configs=("as_written", "smartvjp"))
  m = report.measured
  # the rounds stop at the first round past the budget: 4 programs of at
  # most a few SLEEPs each a round, far below a second beyond it
  assert m["budget_s"] == 0.2
  assert m["timing_s"] < 0.2 + 1.0, m
  assert m["stopped"] == "budget" and m["rounds"] < _measure.MIN_ROUNDS + 10
  assert all(s["measured"]["stopped"] == "budget" for s in report.sites
             if s["measured"]["rounds"] < _measure.MIN_ROUNDS)
  assert time.perf_counter() - t < 60


@pytest.mark.parametrize("budget", [-1.0, float("nan"), "3", True])
def test_a_bad_budget_is_refused(budget):
  with pytest.raises(ValueError, match="timing_budget must be a number"):
    smartvjp.audit(STEP, X, measure=True, timing_budget=budget)


def test_settled_table():
  iv = lambda m, lo, hi, n=20: _timing.Interval(m, lo, hi, n)
  assert _measure.settled(iv(0.5, 0.4, 0.6))           # ±0.1 <= 0.125
  assert not _measure.settled(iv(0.5, 0.3, 0.7))       # ±0.2 > 0.125
  assert _measure.settled(iv(0.0, -0.01, 0.01))        # ±1 point
  assert not _measure.settled(iv(0.0, -0.02, 0.02))
  assert not _measure.settled(iv(0.5, 0.5, 0.5, n=3))  # too few rounds


@pytest.mark.parametrize("saving,want", [
    ((0.2, 0.1, 0.3), "swap"),
    ((0.003, 0.001, 0.004), "no action"),    # below half a point
    ((0.004, 0.001, 0.007), "cannot tell"),  # may or may not reach it
    ((0.0, -0.005, 0.005), "no action"),     # holds 0, narrower than 1 point
    ((0.05, -0.05, 0.15), "cannot tell"),    # holds 0, wider than the band
    ((-0.2, -0.3, -0.1), "no action"),       # a slowdown
])
def test_advice_table(saving, want):
  # the measurement's rules (_calibrate.advice, which measure=True uses)
  assert _calibrate.advice(_timing.Interval(*saving, 20)).kind == want
  # the measurement leads the estimate
  assert _calibrate.advice(_timing.Interval(0.0, 0.0, 0.0, 0),
                           _timing.Interval(*saving, 20)).kind == want


def test_swapped_configuration_table():
  site = _trace.Site(index=3, kind="jax.custom_vjp", fun=None, fwd=None,
                     bwd=None, fwd_bwd=None, nondiff_argnums=(),
                     symbolic_zeros=False, optimize_remat=False,
                     generic_batching=None, refused=None)
  smart = _trace.Site(**{**site.__dict__, "index": 4,
                         "kind": "smart_custom_vjp"})
  one = _trace.swapped({3: "smartvjp_fused"})
  assert one == _trace.swapped({3: "smartvjp_fused"})   # hashable, stable
  assert _trace.site_config(one, site) == ("smartvjp_fused", True)
  assert _trace.site_config(one, smart) == ("as_written", False)
  rest = _trace.swapped({3: "smartvjp"}, rest="as_is")
  assert _trace.site_config(rest, site) == ("smartvjp", False)
  assert _trace.site_config(rest, smart) == ("smartvjp_fused", False)
  with pytest.raises(ValueError):
    _trace.swapped({3: "optimize_remat"})


# -- apply ---------------------------------------------------------------------

def _counts(fn, *args):
  kernels.reset()
  out = jax.block_until_ready(fn(*args))
  return out, {k: v for k, v in kernels.COUNTS.items() if v}


def _want_counts(swapped: set) -> dict:
  out = {}
  for prefix in ("slow.", "even."):
    if prefix in swapped:   # f in the forward pass, fwd in the backward
      out.update({prefix + "f": 1, prefix + "fwd": 1, prefix + "bwd": 1})
    else:                   # fwd in both
      out.update({prefix + "fwd": 2, prefix + "bwd": 1})
  return out


@pytest.mark.parametrize("advice", [("swap", "no action"),
                                    ("no action", "swap"),
                                    ("swap", "swap"),
                                    ("no action", "cannot tell")])
@pytest.mark.parametrize("jit", [False, True])
def test_apply_swaps_only_the_advised_sites(report, advice, jit):
  slow, even = _sites(report)
  saved = slow["advice"], even["advice"]
  slow["advice"], even["advice"] = advice
  try:
    applied = report.apply(STEP)
  finally:
    slow["advice"], even["advice"] = saved
  run = jax.jit(applied) if jit else applied
  want, got = _counts(jax.jit(STEP), X)
  assert got == _want_counts(set())
  value, counts = _counts(run, X)
  assert counts == _want_counts(
      {p for p, a in zip(("slow.", "even."), advice) if a == "swap"})
  # the same values and gradients (the rules are the same numpy kernels)
  np.testing.assert_array_equal(value[0], want[0])
  np.testing.assert_array_equal(value[1], want[1])
  # and the step outside apply is as written again
  _, again = _counts(jax.jit(STEP), X)
  assert again == _want_counts(set())


def test_apply_follows_the_report(report):
  slow, even = _sites(report)
  applied = report.apply(STEP)
  _, counts = _counts(applied, X)
  advised = {p for p, s in (("slow.", slow), ("even.", even))
             if s["advice"] == "swap"}
  assert "slow." in advised
  assert counts == _want_counts(advised)


def test_apply_on_a_jitted_step_with_static_arguments(report):
  def step(x, scale):
    return jax.value_and_grad(lambda x: _loss(x) * scale)(x)
  jitted = jax.jit(step, static_argnums=(1,))
  r = smartvjp.audit(jitted, X, 2.0, configs=("as_written", "smartvjp"))
  for s in r.sites:
    s["advice"] = "swap" if s["index"] == 0 else "no action"
  applied = r.apply(jitted)
  want = jitted(X, 2.0)
  _, counts = _counts(applied, X, 2.0)
  assert counts == _want_counts({"slow."})
  got = applied(X, 2.0)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
  _, counts = _counts(applied, X, 2.0)   # traced once: runs, no trace
  assert counts == _want_counts({"slow."})


def test_apply_matches_jax_custom_vjp_on_jax_coded_rules():
  F = jax.custom_vjp(lambda x, w: jnp.tanh(x @ w))

  def fwd(x, w):
    y = x @ w
    return jnp.tanh(y), (x, w, y)

  def bwd(res, g):
    x, w, y = res
    d = g * (1 - jnp.tanh(y) ** 2)
    return d @ w.T, x.T @ d
  F.defvjp(fwd, bwd)
  step = jax.grad(lambda x, w: jnp.sum(jax.checkpoint(F)(x, w) ** 2),
                  argnums=(0, 1))
  x, w = jnp.ones((4, 8)) * 0.3, jnp.full((8, 8), 0.1)
  r = smartvjp.audit(step, x, w, configs=("as_written", "smartvjp"))
  r.sites[0]["advice"] = "swap"
  got, want = jax.jit(r.apply(step))(x, w), jax.jit(step)(x, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert a.dtype == b.dtype


def test_apply_refuses_a_report_without_its_sites(report):
  from smartvjp.audit import Audit
  with pytest.raises(ValueError, match="read back from JSON"):
    Audit(report.data).apply(STEP)
  with pytest.raises(TypeError, match="must be a function"):
    report.apply(3)


# -- errors are recorded, not raised -------------------------------------------

def test_a_swapped_step_that_does_not_trace_is_recorded():
  from jax.experimental import io_callback

  def f(x):
    return io_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

  F = jax.custom_vjp(f)
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  step = jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x)))
  report = smartvjp.audit(step, X, measure=True, timing_budget=0.2,
                          configs=("as_written", "smartvjp"))
  (s,) = report.sites
  assert "Effects not supported" in s["measured"]["error"]
  m = report.measured
  assert "smartvjp" in m["error"] and m["paired_ratio"] is None
  assert m["seconds"]["as_written"]["median"] > 0   # as written: timed
  # microseconds a run: a sample is many runs, dispatched back to back
  assert m["loop"] > 1
  assert s["advice"] != "swap"
  assert "did not run" in report.table()


def test_shape_dtype_structs_are_filled_and_said():
  report = smartvjp.audit(STEP, jax.ShapeDtypeStruct((8,), jnp.float32),
                          measure=True, timing_budget=0.2,
                          configs=("as_written", "smartvjp"))
  assert report.measured["inputs"].startswith("made up")
  assert all("saving" in s["measured"] for s in report.sites)


# -- shard_map on 4 host devices: a site and its step on one basis -------------

SHARD_MAP = r"""
import time, jax, jax.numpy as jnp, numpy as np, smartvjp
from jax.sharding import AxisType, PartitionSpec as P

def slow(x):
  time.sleep(0.03)
  return np.sin(x), np.cos(x)

F = jax.custom_vjp(lambda x: jax.pure_callback(
    np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
F.defvjp(lambda x: jax.pure_callback(
    slow, (jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2, x),
         lambda c, g: (c * g,))
G = jax.custom_vjp(lambda x: jnp.tanh(x))
G.defvjp(lambda x: (jnp.tanh(x), x),
         lambda x, g: (g * (1 - jnp.tanh(x) ** 2),))
mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))

def loss(x):
  body = lambda x: jnp.sum(jax.checkpoint(lambda x: G(F(x)))(x),
                           keepdims=True)
  return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=P("d"),
                               out_specs=P("d"), check_vma=False)(x))

r = smartvjp.audit(jax.value_and_grad(loss), jnp.linspace(0.1, 1, 16),
                   measure=True, timing_budget=3.0,
                   configs=("as_written", "smartvjp"))
m = r.measured
f, g = sorted(r.sites, key=lambda s: s["index"])
print("STEP", m["measured_saving"], *m["measured_saving_interval"])
print("F", f["measured"]["saving"], *f["measured"]["interval"])
print("G", g["measured"]["saving"], *g["measured"]["interval"])
print("RUNS", f["runs"]["as_written"]["compiled"]["fwd"],
      f["runs"]["smartvjp"]["compiled"]["fwd"])
"""


def test_shard_map_site_and_step_on_one_basis():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", SHARD_MAP], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  got = {line.split()[0]: [float(v) for v in line.split()[1:]]
         for line in proc.stdout.splitlines() if line.split()}
  step, f, g = got["STEP"], got["F"], got["G"]
  # each device drops and reruns its shard's fwd as written: the site's
  # saving is about half the step, as the whole swap's is (not a quarter,
  # one shard's share of four)
  assert f[0] > 0.15 and f[1] > 0, got
  assert abs(g[0]) < 0.2, got
  # and the sites' savings add up to the step's: the step's interval
  # meets the sum of theirs
  assert step[1] <= f[2] + g[2] and f[1] + g[1] <= step[2], got


def test_one_site_is_timed_once_as_the_whole_swap():
  step = jax.value_and_grad(lambda x: jnp.sum(jax.checkpoint(SLOW)(x)))
  report = smartvjp.audit(step, X, measure=True, timing_budget=0.3,
                          configs=("as_written", "smartvjp"))
  (s,) = report.sites
  m = report.measured
  assert s["measured"]["saving"] == m["measured_saving"]
  assert s["measured"]["interval"] == m["measured_saving_interval"]
