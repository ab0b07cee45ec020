"""A fused ``fwd_bwd`` never costs more: the rematerialized backward region
runs ``f`` + ``fwd_bwd`` or ``fwd`` + ``bwd`` by whether it reads the call's
output and by the rules' costs (``_plan.backward_pair``), on both remat
paths, and the printed schedule says which and why.

Kernels are never-DCE'd opaque kernels (``tests/kernels.py``): the counts
are what XLA's compiled program ran."""

import dataclasses
import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import kernels
from smartvjp import _plan, _policy, smart_custom_vjp
from smartvjp import _jaxprs, _remat
from smartvjp._plan import Backward, Cost, Facts, Forward, Schedule

ALL_THREE = Facts(has_fwd=True, has_fwd_bwd=True)
SEED = Facts(has_fwd=True, has_fwd_bwd=True, num_computed=0, inputs_only=True)
CHEAP, DEAR = Cost(0, 10.0, 1, 64), Cost(0, 20.0, 1, 64)

# (name, facts, output read, fused pair's cost, unfused pair's cost,
#  expected backward, expected reason)
PAIRS = [
    ("output not read: fwd_bwd alone", ALL_THREE, False, None, None,
     Backward.FWD_BWD, "output not read"),
    ("output read, fused dearer", ALL_THREE, True, DEAR, CHEAP,
     Backward.FWD_THEN_BWD, "output read; fused costs more"),
    ("output read, fused cheaper", ALL_THREE, True, CHEAP, DEAR,
     Backward.FWD_BWD, "output read; fused costs less"),
    ("a collective more in the fused pair outweighs operations",
     ALL_THREE, True, Cost(2, 1.0, 0, 0), Cost(1, 100.0, 0, 0),
     Backward.FWD_THEN_BWD, "output read; fused costs more"),
    ("operations equal, one opaque kernel more", ALL_THREE, True,
     Cost(0, 0.0, 3, 8), Cost(0, 0.0, 2, 16), Backward.FWD_THEN_BWD,
     "output read; fused costs more"),
    ("a tie: fewer bytes written", ALL_THREE, True, Cost(0, 0.0, 2, 8),
     Cost(0, 0.0, 2, 16), Backward.FWD_BWD,
     "output read; same cost, fused writes less"),
    ("a tie the unfused pair writes less for", ALL_THREE, True,
     Cost(0, 0.0, 2, 32), Cost(0, 0.0, 2, 16), Backward.FWD_THEN_BWD,
     "output read; same cost, unfused writes less"),
    ("costs not known", ALL_THREE, True, None, None, Backward.FWD_THEN_BWD,
     "output read; cost not known"),
    ("remat3: not known whether read, taken as read", ALL_THREE, None, DEAR,
     CHEAP, Backward.FWD_THEN_BWD, "output maybe read; fused costs more"),
    ("the seed's fwd (computes nothing): bwd alone is the other pair", SEED,
     True, DEAR, CHEAP, Backward.BWD, "output read; fused costs more"),
    ("forced fused", dataclasses.replace(ALL_THREE, fused=True), True, DEAR,
     CHEAP, Backward.FWD_BWD, "defvjp fused=True"),
    ("forced apart, output not read", dataclasses.replace(ALL_THREE,
                                                          fused=False),
     False, None, None, Backward.FWD_THEN_BWD, "defvjp fused=False"),
]


@pytest.mark.parametrize("name,facts,read,fused,unfused,backward,why", PAIRS,
                         ids=[r[0] for r in PAIRS])
def test_backward_pair_table(name, facts, read, fused, unfused, backward,
                             why):
  chosen = _plan.backward_pair(facts, read, fused, unfused)
  assert chosen.forward is Forward.F
  assert chosen.backward is backward and chosen.why == why
  assert not chosen.asks_pair   # decided once; later rules read it
  assert str(chosen) == f"f forward, {backward.value} ({why}) backward"


@pytest.mark.parametrize("facts,backward", [
    (ALL_THREE, Backward.FWD_THEN_BWD), (SEED, Backward.BWD),
    (dataclasses.replace(ALL_THREE, fused=True), Backward.FWD_THEN_BWD)])
def test_the_unfused_pair_is_what_backward_pair_weighs(facts, backward):
  """``unfused_schedule``: the pair ``backward_pair`` chooses when it does
  not fuse (the costs' second pair), whatever ``fused=`` forces."""
  apart = _plan.unfused_schedule(facts)
  assert (apart.forward, apart.backward) == (Forward.F, backward)
  assert not apart.why and not apart.runs_fwd_bwd
  unforced = dataclasses.replace(facts, fused=None)
  chosen = _plan.backward_pair(unforced, True, DEAR, CHEAP)
  assert (chosen.forward, chosen.backward) == (apart.forward, apart.backward)


def test_a_plan_leaves_the_pair_to_be_weighed_only_with_fwd_bwd():
  fused = _plan.plan(ALL_THREE, _plan.Answers(_plan.RECOMPUTE,
                                              (_plan.RECOMPUTE,)))
  assert fused.schedule.asks_pair
  apart = _plan.plan(Facts(has_fwd=True, has_fwd_bwd=False),
                     _plan.Answers(_plan.RECOMPUTE, (_plan.RECOMPUTE,)))
  assert not apart.schedule.asks_pair


# -- kernel runs in XLA's compiled program ------------------------------------

def _rules(composite):
  """sin's rules as never-DCE'd kernels; ``composite``: ``fwd_bwd`` runs
  ``fwd``'s kernel then ``bwd``'s (a fused rule written as the two)."""
  f, fwd, bwd, fwd_bwd = kernels.sin_rules(never_dce=True)
  if composite:
    def fwd_bwd(x, g):
      _, res = fwd(x)
      return bwd(res, g)
  return f, fwd, bwd, fwd_bwd


def _column(column, composite):
  f, fwd, bwd, fwd_bwd = _rules(composite)
  if column == "jax.custom_vjp":
    F = jax.custom_vjp(f)
    F.defvjp(fwd, bwd)
  else:
    F = smart_custom_vjp(f)
    if column == "fused":
      F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd)
    else:
      F.defvjp(fwd, bwd)
  return F


POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "names": jax.checkpoint_policies.save_only_these_names("h"),
}


def _grad(F, read, policy, scan):
  def layer(x):
    y = jax.ad_checkpoint.checkpoint_name(F(x), "h")
    # sin reads y in the backward region; + 1 does not
    return jnp.sin(y) if read else y + 1.0
  layer = jax.checkpoint(layer, policy=POLICIES[policy])

  def loss(x):
    if scan:
      x, _ = jax.lax.scan(lambda c, _: (layer(c), None), x, None, length=3)
    else:
      for _ in range(3):
        x = layer(x)
    return jnp.sum(x)
  return jax.jit(jax.grad(loss))


# (fwd_bwd a composite of fwd's and bwd's kernels, output read, scan)
CASES = [(True, True, False), (False, False, False), (True, True, True),
         (False, True, False)]


@pytest.mark.parametrize("flags", [False, True], ids=["default", "remat3"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_fused_column_runs_no_more_kernels(flags, policy):
  if flags and not kernels.has_flag("jax_remat3"):
    pytest.skip("no jax_remat3 flag")
  x = jnp.linspace(0.1, 0.9, 16, dtype=jnp.float32).reshape(4, 4)
  flag_values = dict(jax_remat3=True, jax_custom_vjp3=True) if flags else {}
  with kernels.config(**flag_values):
    for composite, read, scan in CASES:
      runs, grads = {}, {}
      for column in ("jax.custom_vjp", "smartvjp", "fused"):
        grads[column], counts = kernels.run(
            _grad(_column(column, composite), read, policy, scan), x)
        runs[column] = sum(counts.values())
      case = dict(composite=composite, read=read, scan=scan, runs=runs)
      assert runs["fused"] <= runs["smartvjp"], case
      if not read and not composite:   # where fwd_bwd pays, it is used
        assert runs["fused"] < runs["smartvjp"], case
      for column in ("smartvjp", "fused"):
        np.testing.assert_array_equal(grads[column], grads["jax.custom_vjp"])


@pytest.mark.parametrize("fused,expect", [(True, "fwd_bwd"), (False, "bwd")])
def test_defvjp_fused_forces_the_pair(fused, expect):
  f, fwd, bwd, fwd_bwd = _rules(False)
  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd, fused=fused)
  _, counts = kernels.run(_grad(F, False, "nothing_saveable", False),
                          jnp.ones((4, 4)))
  assert counts.get(expect) == 3, counts
  assert counts.get("fwd_bwd" if expect == "bwd" else "bwd") is None, counts


def test_defvjp_fused_must_be_a_bool():
  F = smart_custom_vjp(jnp.sin)
  with pytest.raises(TypeError, match="fused must be None, True or False"):
    F.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g,), fused="yes")


def _staged_jvp(F):
  """``F``'s jvp equation as the checkpoint stages it, asking for the pair
  (``f`` forward, ``fwd_bwd`` backward)."""
  x = jnp.ones(4)
  jaxpr = jax.make_jaxpr(lambda x, t: jax.jvp(F, (x,), (t,)))(x, x).jaxpr
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "smartvjp_jvp"]
  return eqn.replace(params=dict(eqn.params, schedule=Schedule(
      Forward.F, Backward.FWD_BWD)))


def test_printed_schedule_says_which_and_why():
  """The staged jvp as the checkpoint's dead-code elimination leaves it
  where the backward region reads the output: the pair and the reason."""
  f, fwd, bwd, fwd_bwd = _rules(True)
  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd)
  eqn = _staged_jvp(F)
  _, kept = _remat._jvp_dce([True, True], eqn)
  assert kept.params["schedule"].backward is Backward.FWD_THEN_BWD
  assert "backward=fwd+bwd (output read; fused costs more)" in str(kept)
  _, lin = _remat._jvp_dce([False, True], eqn)   # output unread: fused alone
  assert lin.primitive.name == "smartvjp_lin" and lin.params["fwd"] is None


# -- collectives -----------------------------------------------------------------

def _psum_rules():
  """f's output and fwd_bwd's recompute each hold a psum; bwd none."""
  def f(x):
    return jax.lax.psum(jnp.sin(x), "i")

  def fwd(x):
    return jax.lax.psum(jnp.sin(x), "i"), jnp.cos(x)

  def bwd(c, g):
    return (c * g,)

  def fwd_bwd(x, g):
    y, c = fwd(x)
    return bwd(c, g + 0 * y)
  return f, fwd, bwd, fwd_bwd


@pytest.mark.parametrize("flags", [False, True], ids=["default", "remat3"])
def test_fused_column_emits_no_more_collectives(flags):
  if flags and not kernels.has_flag("jax_remat3"):
    pytest.skip("no jax_remat3 flag")
  mesh = jax.make_mesh((1,), ("i",))
  spec = jax.sharding.PartitionSpec()
  counts = {}
  flag_values = dict(jax_remat3=True, jax_custom_vjp3=True) if flags else {}
  for column in ("smartvjp", "fused"):
    f, fwd, bwd, fwd_bwd = _psum_rules()
    F = smart_custom_vjp(f)
    F.defvjp(fwd, bwd, **({"fwd_bwd": fwd_bwd} if column == "fused" else {}))

    def layer(x):
      return jnp.sin(F(x))
    body = functools.partial(jax.shard_map, mesh=mesh, in_specs=spec,
                             out_specs=spec, check_vma=False)(
        jax.checkpoint(layer))
    with kernels.config(**flag_values):
      text = jax.jit(jax.grad(lambda x: jnp.sum(body(x)))).lower(
          jnp.ones(4)).as_text()
    counts[column] = text.count("all_reduce")
  assert counts["fused"] <= counts["smartvjp"], counts


# -- a kernel's own cost estimate ------------------------------------------------

def _estimated_kernel(flops):
  """A Pallas kernel (interpret mode) computing ``x + 1`` whose
  ``cost_estimate`` claims ``flops``."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  return lambda x: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=True, cost_estimate=pl.CostEstimate(
          flops=flops, transcendentals=0, bytes_accessed=0))(x)


def test_a_kernels_cost_estimate_is_weighed_per_trip():
  x = jnp.ones(8)
  once = _jaxprs.plan_cost(jax.make_jaxpr(_estimated_kernel(100))(x))
  assert (once.kernels, once.flops) == (1, 100.0)
  looped = jax.make_jaxpr(lambda x: jax.lax.scan(
      lambda c, _: (_estimated_kernel(100)(c), None), x, None, length=3)[0])
  assert _jaxprs.plan_cost(looped(x)).flops == 300.0


@pytest.mark.parametrize("fwd_bwd_flops,backward", [
    (50, Backward.FWD_BWD), (500, Backward.FWD_THEN_BWD)])
def test_kernel_estimates_choose_the_pair(fwd_bwd_flops, backward):
  """Equal kernels and bytes: the estimates decide (f 100 + fwd_bwd
  against fwd 100 + bwd 100), and the printed reason says so."""
  f = _estimated_kernel(100)
  F = smart_custom_vjp(f)
  F.defvjp(lambda x: (f(x), f(x)),     # a residual: f's output, in fwd
           lambda _, g: (_estimated_kernel(100)(g),),
           fwd_bwd=lambda x, g: (_estimated_kernel(fwd_bwd_flops)(g),))
  _, kept = _remat._jvp_dce([True, True], _staged_jvp(F))
  chosen = kept.params["schedule"]
  assert chosen.backward is backward
  assert chosen.why == ("output read; fused costs "
                        + ("less" if backward is Backward.FWD_BWD else "more"))


def test_the_lms_rmsnorm_runs_fwd_and_bwd_where_its_output_is_read():
  """examples/pallas_rmsnorm_gelu.py's kernels at benchmarks/tpu_lm.py's
  shape (the TPU kernels, traced only): the fused pair recomputes the norm
  in ``fwd_bwd``, which its estimate counts, so where the output is read
  ``fwd`` + ``bwd`` is chosen (on the TPU v5e the fused pair was 0.3%
  slower in the LM under dots_saveable)."""
  path = os.path.join(os.path.dirname(__file__), os.pardir, "examples",
                      "pallas_rmsnorm_gelu.py")
  spec = importlib.util.spec_from_file_location("_rmsnorm_example", path)
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  _, rules = example.make_rmsnorm_gelu(target="tpu", interpret=False)
  x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((1024,), jnp.bfloat16)
  out, res = jax.eval_shape(rules["fwd"], x, g)
  cost = {name: _jaxprs.plan_cost(jax.make_jaxpr(rules[name])(*args))
          for name, args in [("f", (x, g)), ("fwd", (x, g)),
                             ("bwd", (res, out)), ("fwd_bwd", (x, g, out))]}
  assert all(c.flops > 0 for c in cost.values()), cost
  chosen = _plan.backward_pair(ALL_THREE, True, cost["f"] + cost["fwd_bwd"],
                               cost["fwd"] + cost["bwd"])
  assert chosen.backward is Backward.FWD_THEN_BWD, chosen
