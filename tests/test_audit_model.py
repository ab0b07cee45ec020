"""The audit's time model (``smartvjp/audit/_model.py``, a roofline of XLA's
cost analysis plus kernel launches) as a table, the loop correction it
needs, and the per-site predictions summing to the whole step's."""

import jax
import jax.numpy as jnp
import pytest

import kernels as K
import smartvjp
from smartvjp import smart_custom_vjp
from smartvjp.audit import _analysis as A
from smartvjp.audit import _model as M

PK = dict(flops=100.0, bytes=10.0, launch=1.0)

# cost, launches -> (compute, memory, launch, total) seconds on PK
SECONDS = [
    ({}, 0, (0.0, 0.0, 0.0, 0.0)),
    ({"flops": 200.0}, 0, (2.0, 0.0, 0.0, 2.0)),
    ({"flops": 200.0, "transcendentals": 100.0}, 0, (3.0, 0.0, 0.0, 3.0)),
    ({"bytes_accessed": 50.0}, 0, (0.0, 5.0, 0.0, 5.0)),
    # summed, not the max: a saving in the resource that does not bind
    # the step still shows
    ({"flops": 200.0, "bytes_accessed": 50.0}, 0, (2.0, 5.0, 0.0, 7.0)),
    ({"flops": 200.0, "bytes_accessed": 50.0}, 3, (2.0, 5.0, 3.0, 10.0)),
    ({"flops": 0.0}, None, (0.0, 0.0, 0.0, 0.0)),
]


@pytest.mark.parametrize("cost,launches,want", SECONDS)
def test_seconds_table(cost, launches, want):
  got = M.seconds(cost, launches, PK)
  assert tuple(got[k] for k in ("compute", "memory", "launch", "total")) \
      == pytest.approx(want)


RATIOS = [
    ({"total": 5.0}, {"total": 10.0}, 0.5),
    ({"total": 10.0}, {"total": 10.0}, 1.0),
    ({"total": 12.0}, {"total": 10.0}, 1.2),
    ({"total": 1.0}, {"total": 0.0}, None),
    (None, {"total": 1.0}, None),
]


@pytest.mark.parametrize("cand,base,want", RATIOS)
def test_ratio_table(cand, base, want):
  assert M.ratio(cand, base) == (pytest.approx(want) if want else want)


# runs, rule seconds, opaque, launches -> site seconds on PK
RUNS = dict.fromkeys(("f", "fwd", "bwd", "fwd_bwd"), 0)
OWN = {"f": 1.0, "fwd": 3.0, "bwd": 2.0, "fwd_bwd": 4.0}
SITES = [
    # opaque fwd run twice (forward pass and rematerialized): both paid
    (dict(RUNS, fwd=2, bwd=1), OWN, True, 3, 3.0 * 2 + 2.0 + 3.0),
    # JAX-coded: the forward pass's fwd costs f (XLA drops residual work)
    (dict(RUNS, fwd=2, bwd=1), OWN, False, 0, 1.0 + 3.0 + 2.0),
    (dict(RUNS, f=1, fwd=1, bwd=1), OWN, True, 2, 1.0 + 3.0 + 2.0 + 2.0),
    (dict(RUNS, f=1, fwd_bwd=1), OWN, True, 2, 1.0 + 4.0 + 2.0),
    # a multiplicity of 4 (a scan) is in the runs
    (dict(RUNS, fwd=8, bwd=4), OWN, False, 0, 4 * (1.0 + 3.0 + 2.0)),
    # f did not trace: the extra fwd is priced as fwd
    (dict(RUNS, fwd=2, bwd=1), {"fwd": 3.0, "bwd": 2.0}, False, 0, 8.0),
]


@pytest.mark.parametrize("runs,own,opaque,launches,want", SITES)
def test_site_seconds_table(runs, own, opaque, launches, want):
  assert M.site_seconds(runs, own, opaque, launches, PK) == pytest.approx(want)


def test_peaks_for():
  peaks, source = M.peaks_for("TPU v5 lite", "tpu")
  assert (peaks["flops"], peaks["bytes"]) == (197e12, 819e9)
  assert "TPU v5 lite" in source
  peaks, source = M.peaks_for("some cpu", "cpu", {"launch": 0.5})
  assert peaks == dict(M.PEAKS["cpu"], launch=0.5) and "argument" in source
  assert M.peaks_for("TPU v99", "tpu")[0] is None
  peaks, source = M.peaks_for("TPU v99", "tpu", dict(PK))
  assert peaks == PK and source == "argument"
  assert M.peaks_for("TPU v99", "tpu", {"flops": 1.0})[0] is None
  with pytest.raises(ValueError, match="unknown key"):
    M.peaks_for("cpu", "cpu", {"bandwidth": 1.0})


# -- XLA's cost of a loop, and the correction ---------------------------------------

def _scan_step(n):
  w = jnp.ones((64, 64))
  body = lambda c, _: (jnp.tanh(c @ w), None)
  return jax.jit(lambda x: jax.lax.scan(body, x, None, length=n)[0])


def test_xla_counts_a_loop_body_once_and_the_audit_corrects_it():
  """The fact the correction rests on: XLA's cost analysis of a scan of 1
  and of 5 steps gives the same flops on this JAX (if a release starts
  multiplying by the trip count, this fails and the correction must go)."""
  x = jnp.ones((8, 64))
  one, five = (A._cost(_scan_step(n).lower(x).compile()) for n in (1, 5))
  assert one["flops"] > 0 and five["flops"] == pytest.approx(one["flops"],
                                                             rel=1e-3)
  closed = jax.make_jaxpr(_scan_step(5))(x)
  notes = []
  trips = A.compiled_trips(_scan_step(5).lower(x).compile().as_text())
  fix = A.loop_correction(closed.jaxpr, trips, notes, {})
  # four more bodies' worth (2*8*64*64 flops each), nothing else
  assert fix["flops"] == pytest.approx(4 * 2 * 8 * 64 * 64, rel=0.01)
  assert not notes


# -- per site: each site's own prediction, summing to the step's -------------------

def _layer(act, dact):
  """A layer whose fused rule never forms ``w @ w``, which ``fwd`` saves."""
  @smart_custom_vjp
  def layer(x, w):
    return act(x @ (w @ w))

  def fwd(x, w):
    m = w @ w
    h = x @ m
    return act(h), (x, w, m, h)

  def bwd(res, g):
    x, w, m, h = res
    gh = dact(h) * g
    gm = x.T @ gh
    return gh @ m.T, gm @ w.T + w.T @ gm

  def fwd_bwd(x, w, g):
    h = (x @ w) @ w
    gh = dact(h) * g
    gm = x.T @ gh
    return (gh @ w.T) @ w.T, gm @ w.T + w.T @ gm

  layer.defvjp(fwd, bwd, fwd_bwd=fwd_bwd)
  return layer


def test_site_predictions_sum_to_the_step_prediction():
  """Two sites in a scanned, checkpointed body, with fused rules that skip
  a 256x256x256 matmul per run: each site's own predicted saving (runs
  saved per rule times the rule's own cost, compiled alone) and the whole
  step's (the two compiled steps' costs, loops scaled) agree within 15%
  (the tolerance held to on the TPU): the flops agree, the bytes do not
  (a rule compiled alone reads and writes what fuses with its neighbours
  in the step: here the rules say 2 MB saved, the steps 0.15 MB more)."""
  big = _layer(jnp.sin, jnp.cos)
  small = _layer(jnp.tanh, lambda h: 1 - jnp.tanh(h) ** 2)

  def step(x, w1, w2):
    def body(c, w):
      y = jax.checkpoint(small)(c[:, :128], w[0][:128, :128])
      y = jnp.concatenate([y, c[:, 128:]], axis=1)
      return jax.checkpoint(big)(y, w[1]), None
    loss = lambda *a: jnp.sum(jax.lax.scan(body, a[0], a[1:])[0] ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)

  S = jax.ShapeDtypeStruct
  w = S((3, 256, 256), jnp.float32)
  a = smartvjp.audit(step, S((8, 256), jnp.float32), w, w,
                     configs=("as_written", "smartvjp", "smartvjp_fused"))
  p = a.predicted
  assert p["candidate"] == "smartvjp_fused"
  saved = [s["predicted"]["seconds_saved"] for s in a.sites]
  assert all(x > 0 for x in saved)
  # sorted by predicted saving: the 256-wide layer first
  assert saved == sorted(saved, reverse=True) and saved[0] > 4 * saved[1]
  assert a.sites[0]["predicted"]["rule_cost"]["fwd"]["flops"] \
      > 2 * 256 ** 3
  assert p["sites_seconds_saved"] == pytest.approx(sum(saved))
  assert p["seconds_saved"] == pytest.approx(sum(saved), rel=0.15)
  assert p["predicted_ratio"] < 1
  st = a.data["step"]["as_written"]
  assert st["cost_loops_scaled"]["flops"] > 2.5 * st["cost"]["flops"]


def test_peaks_argument_and_callback_note():
  """``peaks=`` replaces the table's figures (a launch priced at a second
  makes the launches saved the whole step's prediction), an unknown key
  is a ValueError, and a callback kernel, whose work XLA's cost analysis
  cannot see, leaves its site unpriced (no seconds: ``None``, not 0) and
  the step's figure partial."""
  f, fwd, bwd, fb = K.sin_rules(False)   # jax.pure_callback kernels
  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd, fwd_bwd=fb)   # fwd twice and bwd, or f and fwd_bwd
  step = jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x) ** 2))
  x = jnp.ones(3)
  a = smartvjp.audit(step, x, configs=("as_written", "smartvjp_fused"),
                     peaks={"launch": 1.0})
  assert a.data["model"]["peaks"]["launch"] == 1.0
  assert "argument" in a.data["model"]["peaks_source"]
  (s,) = a.sites
  assert s["predicted"]["launches_saved"] == 1
  assert s["predicted"]["seconds_saved"] is None
  assert s["predicted"]["share_of_step"] is None
  assert s["predicted"]["unpriced"]["fwd"] == ["pure_callback"]
  assert a.predicted["seconds_saved"] == pytest.approx(1.0, rel=1e-3)
  assert a.predicted["partial"] and a.predicted["unpriced_sites"] == [
      s["name"]]
  assert any("unpriced: calibrate=True times it" in n
             for n in a.data["model"]["notes"])
  assert "partial: it cannot price pure_callback" in a.table()
  with pytest.raises(ValueError, match="unknown key"):
    smartvjp.audit(step, x, peaks={"hbm": 1.0})


def test_a_pallas_call_counts_at_its_own_cost_estimate():
  """A rule's cost counts each ``pallas_call`` at its ``cost_estimate``
  (here 1e9 flops, where the interpreted kernel does 2 per element), in a
  scan once per iteration; the rest of the rule as XLA sees it."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + 1.0

  est = pl.CostEstimate(flops=10**9, transcendentals=10**3,
                        bytes_accessed=10**6)
  call = lambda x: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=True, cost_estimate=est)(x)
  x = jnp.ones((8, 128))
  w = jnp.ones((128, 128))
  one = A.rule_cost(jax.make_jaxpr(lambda x: call(x) @ w)(x))
  matmul = 2 * 8 * 128 * 128
  assert one["flops"] == pytest.approx(1e9 + matmul, rel=1e-3)
  assert one["transcendentals"] == pytest.approx(1e3, rel=1e-3)
  assert one["source"] == "xla+pallas_estimate"
  looped = A.rule_cost(jax.make_jaxpr(lambda x: jax.lax.scan(
      lambda c, _: (call(c) @ w, None), x, None, length=4)[0])(x))
  assert looped["flops"] == pytest.approx(4 * (1e9 + matmul), rel=1e-3)


def test_a_pallas_call_without_an_estimate_is_named_in_the_notes():
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...])

  call = lambda x: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=True)(x)
  F = jax.custom_vjp(call)
  F.defvjp(lambda x: (call(x), x), lambda x, g: (jnp.cos(x) * g,))
  a = smartvjp.audit(jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x))),
                     jnp.ones((8, 128)), configs=("as_written", "smartvjp"))
  (s,) = a.sites
  assert s["predicted"]["rule_cost"]["fwd"]["pallas_calls_without_estimate"] \
      == 1
  assert any("pallas_call(s) without a cost_estimate in f (1), fwd (1)" in n
             for n in a.data["model"]["notes"]), a.data["model"]["notes"]
