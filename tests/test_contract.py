"""The core contract: kernel executions per call site, row by row.

Every differentiated row runs with direct linearize on and off (the
``linearize`` fixture), on JAX's default path and under the remat3 flags
(``ad_mode``), and with both kinds of
counting kernel (``pure_callback``, which JAX/XLA may remove when unused, and
a never-DCE'd primitive, like a Pallas or Triton call). Every value is
compared against ``jax.custom_vjp`` with the same rules.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import kernels as K
from kernels import run
from smartvjp import smart_custom_vjp

X = jnp.array([0.3, -1.2, 2.0], jnp.float32)


def build(never_dce, fwd_bwd="no", seed_fwd=False, named=None):
  """(smart F, jax.custom_vjp F) with kernel rules for sin."""
  f, fwd, bwd, fb = K.sin_rules(never_dce)
  if seed_fwd:  # the seed's own fwd: residual is the input x
    def fwd(x):
      (y,) = K.kernel("fwd", lambda x: (np.sin(x),), [x], x, never_dce=never_dce)
      return y, (x,)

    def bwd(res, g):
      (x,) = res
      (dx,) = K.kernel("bwd", lambda x, g: (np.cos(x) * g,), [g], x, g,
                       never_dce=never_dce)
      return (dx,)
  if named:
    plain_fwd = fwd

    def fwd(x):
      y, (c,) = plain_fwd(x)
      return y, (checkpoint_name(c, named),)

  smart = smart_custom_vjp(f)
  if fwd_bwd == "only":
    smart.defvjp(fwd_bwd=fb)
  elif fwd_bwd == "also":
    smart.defvjp(fwd, bwd, fwd_bwd=fb)
  else:
    smart.defvjp(fwd, bwd)
  ref = jax.custom_vjp(f)
  ref.defvjp(fwd, bwd)
  return smart, ref


def loss(F, remat=False, policy=None):
  G = jax.checkpoint(F, policy=policy) if remat else F
  return lambda x: jnp.sum(G(x) ** 2)


def check(smart_prog, ref_prog, expected, *args):
  out, got = run(smart_prog, *args)
  ref, _ = run(ref_prog, *args)
  np.testing.assert_allclose(out, ref, rtol=1e-6)
  assert got == expected


def test_primal(never_dce):
  F, R = build(never_dce)
  check(F, R, {"f": 1}, X)
  check(jax.jit(F), jax.jit(R), {"f": 1}, X)


def test_grad_without_remat(never_dce, ad_mode, linearize):
  F, R = build(never_dce)
  check(jax.jit(jax.grad(loss(F))), jax.jit(jax.grad(loss(R))),
        {"fwd": 1, "bwd": 1}, X)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_grad_with_checkpoint(never_dce, ad_mode, linearize, jit):
  F, R = build(never_dce)
  wrap = jax.jit if jit else (lambda f: f)
  check(wrap(jax.grad(loss(F, True))), wrap(jax.grad(loss(R, True))),
        {"f": 1, "fwd": 1, "bwd": 1}, X)


def test_seed_fwd_residual_is_input(never_dce, ad_mode, linearize):
  F, R = build(never_dce, seed_fwd=True)
  check(jax.jit(jax.grad(loss(F, True))), jax.jit(jax.grad(loss(R, True))),
        {"f": 1, "bwd": 1}, X)


def test_scan_of_checkpointed_layer(never_dce, ad_mode, linearize):
  F, R = build(never_dce)

  def scanned(F):
    def body(c, _):
      return jax.checkpoint(F)(c), None
    return lambda x: jnp.sum(jax.lax.scan(body, x, None, length=4)[0] ** 2)

  check(jax.jit(jax.grad(scanned(F))), jax.jit(jax.grad(scanned(R))),
        {"f": 4, "fwd": 4, "bwd": 4}, X)


def test_two_calls_in_one_checkpoint(never_dce, ad_mode, linearize):
  F, R = build(never_dce)
  two = lambda F: (lambda x: jnp.sum(jax.checkpoint(lambda x: F(F(x)))(x) ** 2))
  check(jax.jit(jax.grad(two(F))), jax.jit(jax.grad(two(R))),
        {"f": 2, "fwd": 2, "bwd": 2}, X)


def test_everything_saveable(never_dce, ad_mode, linearize):
  F, R = build(never_dce)
  p = jax.checkpoint_policies.everything_saveable
  check(jax.jit(jax.grad(loss(F, True, p))), jax.jit(jax.grad(loss(R, True, p))),
        {"fwd": 1, "bwd": 1}, X)


def test_named_residual_saved_by_policy(never_dce, ad_mode, linearize):
  F, R = build(never_dce, named="gelu_res")
  p = jax.checkpoint_policies.save_only_these_names("gelu_res")
  check(jax.jit(jax.grad(loss(F, True, p))), jax.jit(jax.grad(loss(R, True, p))),
        {"fwd": 1, "bwd": 1}, X)


def test_named_residual_not_listed_is_recomputed(never_dce, ad_mode, linearize):
  F, R = build(never_dce, named="gelu_res")
  p = jax.checkpoint_policies.save_only_these_names("other")
  check(jax.jit(jax.grad(loss(F, True, p))), jax.jit(jax.grad(loss(R, True, p))),
        {"f": 1, "fwd": 1, "bwd": 1}, X)


def test_checkpoint_with_fwd_bwd(never_dce, ad_mode, linearize):
  F, R = build(never_dce, fwd_bwd="also")
  check(jax.jit(jax.grad(loss(F, True))), jax.jit(jax.grad(loss(R, True))),
        {"f": 1, "fwd_bwd": 1}, X)


def test_no_checkpoint_with_fwd_bwd(never_dce, ad_mode, linearize):
  F, R = build(never_dce, fwd_bwd="also")
  check(jax.jit(jax.grad(loss(F))), jax.jit(jax.grad(loss(R))),
        {"fwd": 1, "bwd": 1}, X)


@pytest.mark.parametrize("remat", [True, False], ids=["remat", "no_remat"])
def test_only_fwd_bwd(never_dce, ad_mode, linearize, remat):
  F, R = build(never_dce, fwd_bwd="only")
  check(jax.jit(jax.grad(loss(F, remat))), jax.jit(jax.grad(loss(R, remat))),
        {"f": 1, "fwd_bwd": 1}, X)


def test_offloaded_named_residual(never_dce, ad_mode):
  F, R = build(never_dce, named="gelu_res")
  p = jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=["gelu_res"],
      offload_src="device", offload_dst="pinned_host")
  check(jax.jit(jax.grad(loss(F, True, p))), jax.jit(jax.grad(loss(R, True, p))),
        {"fwd": 1, "bwd": 1}, X)
  jaxpr = str(jax.make_jaxpr(jax.grad(loss(F, True, p)))(X))
  assert "<host>" in jaxpr and "device_put" in jaxpr


def _jax_coded_matmul(extra_unnamed=False, cls=smart_custom_vjp):
  f, fwd, bwd = K.matmul_tanh_rules(extra_unnamed)
  F = cls(f)
  F.defvjp(fwd, bwd)
  return F


def _forward_pass(F, policy):
  x, w = jnp.ones((4, 3)), jnp.full((3, 2), 0.1)
  text = str(jax.make_jaxpr(jax.grad(
      lambda x, w: jnp.sum(jax.checkpoint(F, policy=policy)(x, w)),
      (0, 1)))(x, w))
  return text.split("remat2")[0]   # the equations before the backward region


@pytest.mark.parametrize("policy,runs", [
    (jax.checkpoint_policies.dots_saveable, "smartvjp_fwd"),       # dot output
    (jax.checkpoint_policies.nothing_saveable, "smartvjp_primal"),
    (jax.checkpoint_policies.save_only_these_names("y"), "smartvjp_fwd"),
    (jax.checkpoint_policies.save_only_these_names("z"), "smartvjp_primal"),
])
def test_policy_asks_about_the_equation_producing_each_residual(policy, runs):
  forward = _forward_pass(_jax_coded_matmul(), policy)
  assert runs in forward
  assert {"smartvjp_fwd", "smartvjp_primal"} - {runs} & set(forward.split()) == set()


def test_an_unsaveable_unnamed_residual_is_recomputed_alone():
  # y is named and saveable, sum(x, 1) is not: as with jax.custom_vjp and
  # JAX-coded rules, y is saved (the forward pass runs the part of fwd that
  # computes it, not f) and only sum(x, 1) is recomputed backward, from x
  F = _jax_coded_matmul(extra_unnamed=True)
  policy = jax.checkpoint_policies.save_only_these_names("y")
  forward = _forward_pass(F, policy)
  assert "smartvjp_fwd" in forward
  assert "smartvjp_call" not in forward and "smartvjp_primal" not in forward
  x, w = jnp.ones((64, 48)), jnp.full((48, 32), 0.1)
  flops = {}
  for name, G in (("smartvjp", F), ("jax", _jax_coded_matmul(
      extra_unnamed=True, cls=jax.custom_vjp))):
    grad = jax.jit(jax.grad(
        lambda x, w: jnp.sum(jax.checkpoint(G, policy=policy)(x, w)), (0, 1)))
    cost = grad.lower(x, w).compile().cost_analysis()
    flops[name] = (cost[0] if isinstance(cost, list) else cost)["flops"]
  # one matmul forward, two backward (recomputing it would add a third)
  assert flops["smartvjp"] <= flops["jax"] < 4 * (2 * 64 * 48 * 32)


def test_literal_argument_with_saved_residuals(ad_mode):
  # a Python constant argument becomes a Literal in the jaxpr
  def build(cls):
    F = cls(lambda x, y: jnp.sin(x) * y)
    F.defvjp(lambda x, y: (jnp.sin(x) * y, (jnp.cos(x), jnp.sin(x), y)),
             lambda r, g: (g * r[0] * r[2], jnp.sum(g * r[1])))
    return F
  p = jax.checkpoint_policies.everything_saveable
  grads = [jax.grad(lambda x: jnp.sum(jax.checkpoint(
      lambda x: build(cls)(x, 2.0), policy=p)(x)))(X)
      for cls in (smart_custom_vjp, jax.custom_vjp)]
  np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6)


# -- eager programs (no jit): never more launches than jax.custom_vjp ---------
#
# Eagerly nothing removes unused work after the fact (JAX evaluates the
# backward region of jax.checkpoint equation by equation), so jax.custom_vjp's
# counts depend on the kind of kernel: a fwd whose only residual is the input
# runs once with callback kernels, twice with never-DCE'd ones.


def check_no_more(smart_prog, ref_prog, expected, *args):
  """``check``, plus: no more launches in all than ``jax.custom_vjp``."""
  out, got = run(smart_prog, *args)
  ref, ref_counts = run(ref_prog, *args)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               out, ref)
  assert got == expected
  assert sum(got.values()) <= sum(ref_counts.values()), (got, ref_counts)


P = jax.checkpoint_policies
EAGER = {
    "grad": (lambda F: jax.grad(loss(F)), {"fwd": 1, "bwd": 1}),
    "vjp": (lambda F: lambda x: jax.vjp(loss(F), x)[1](1.0),
            {"fwd": 1, "bwd": 1}),
    "grad_checkpoint": (lambda F: jax.grad(loss(F, True)),
                        {"f": 1, "fwd": 1, "bwd": 1}),
    "value_and_grad_checkpoint": (
        lambda F: jax.value_and_grad(loss(F, True)),
        {"f": 1, "fwd": 1, "bwd": 1}),
    "vjp_checkpoint": (lambda F: lambda x: jax.vjp(loss(F, True), x)[1](1.0),
                       {"f": 1, "fwd": 1, "bwd": 1}),
    "nothing_saveable": (lambda F: jax.grad(loss(F, True, P.nothing_saveable)),
                         {"f": 1, "fwd": 1, "bwd": 1}),
    "dots_saveable": (lambda F: jax.grad(loss(F, True, P.dots_saveable)),
                      {"f": 1, "fwd": 1, "bwd": 1}),
    "everything_saveable": (
        lambda F: jax.grad(loss(F, True, P.everything_saveable)),
        {"fwd": 1, "bwd": 1}),
}


@pytest.mark.parametrize("program", list(EAGER))
def test_eager(never_dce, program):
  F, R = build(never_dce)
  make, expected = EAGER[program]
  check_no_more(make(F), make(R), expected, X)


@pytest.mark.parametrize("program", list(EAGER))
def test_eager_seed_fwd_residual_is_input(never_dce, program):
  # issue 12 item 3: f ran again in the backward region for nothing; fwd
  # computes nothing that f does not, so f stands in for it under remat
  F, R = build(never_dce, seed_fwd=True)
  make, _ = EAGER[program]
  expected = ({"fwd": 1, "bwd": 1} if program in ("grad", "vjp")
              else {"f": 1, "bwd": 1})
  check_no_more(make(F), make(R), expected, X)


@pytest.mark.parametrize("outer", ["sum", "square_inside"])
def test_eager_checkpoint_seed_fwd_loss_shapes(never_dce, outer):
  # the primal output is used in the backward region (square_inside) or not
  F, R = build(never_dce, seed_fwd=True)
  progs = {
      "sum": lambda F: jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x))),
      "square_inside": lambda F: jax.grad(lambda x: jnp.sum(
          jax.checkpoint(lambda x: F(x) ** 2)(x))),
  }
  expected = {"f": 1, "bwd": 1} if outer == "sum" else {"f": 2, "bwd": 1}
  check_no_more(progs[outer](F), progs[outer](R), expected, X)


def test_eager_checkpoint_with_fwd_bwd(never_dce):
  F, R = build(never_dce, fwd_bwd="also")
  check_no_more(jax.grad(loss(F, True)), jax.grad(loss(R, True)),
                {"f": 1, "fwd_bwd": 1}, X)


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
def test_eager_linearize_of_opaque_rules_raises(never_dce, remat):
  # forward mode needs a transposable bwd; both raise a TypeError, after no
  # more launches than jax.custom_vjp
  F, R = build(never_dce)
  counts = []
  for G in (F, R):
    G = jax.checkpoint(G) if remat else G
    K.reset()
    with pytest.raises(TypeError):
      jax.linearize(G, X)[1](X)
    counts.append(dict(K.COUNTS))
  assert sum(counts[0].values()) <= sum(counts[1].values()), counts


# -- no data path carries a cotangent to the call (issue 12 item 2) -----------

def _stopped(F, remat=False, scan=False):
  G = jax.checkpoint(F) if remat else F
  if scan:
    def H(x):
      return jax.lax.scan(lambda c, _: (G(c), None), x, None, length=3)[0]
  else:
    H = G
  return jax.value_and_grad(lambda x: jnp.sum(jax.lax.stop_gradient(H(x)))
                            + jnp.sum(x ** 2))


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("seed_fwd", [False, True], ids=["fwd", "seed_fwd"])
def test_dead_linear_part_runs_one_rule(never_dce, ad_mode, remat, seed_fwd):
  # under jax.checkpoint f is traced for the forward pass anyway, and runs
  # alone, as optimize_remat=True does under jit; without it, where
  # jax.grad linearizes the call where it is made, f is not traced (as with
  # jax.custom_vjp, which runs fwd there), so fwd runs
  F, R = build(never_dce, seed_fwd=seed_fwd)
  check_no_more(jax.jit(_stopped(F, remat)), jax.jit(_stopped(R, remat)),
                {"f": 1} if remat else {"fwd": 1}, X)


def test_dead_linear_part_in_scan(never_dce, ad_mode):
  F, R = build(never_dce)
  check_no_more(jax.jit(_stopped(F, scan=True)),
                jax.jit(_stopped(R, scan=True)), {"f": 3}, X)


def test_zero_cotangent_path_still_runs_bwd(never_dce, ad_mode):
  # a cotangent path exists even if it carries zeros: bwd must run, as with
  # jax.custom_vjp (its result need not be zero)
  F, R = build(never_dce)
  prog = lambda F: jax.jit(jax.grad(lambda x: jnp.sum(F(x) * 0.0)))
  check_no_more(prog(F), prog(R), {"fwd": 1, "bwd": 1}, X)


def test_dead_linear_part_of_a_vmapped_call():
  # callback kernels only: the never-DCE'd test kernel has no batching rule
  F, R = build(False)
  prog = lambda F: jax.jit(jax.value_and_grad(
      lambda x: jnp.sum(jax.lax.stop_gradient(jax.vmap(F)(x)))
      + jnp.sum(x ** 2)))
  # linearized where it is made (grad over vmap): fwd, f never traced
  check_no_more(prog(F), prog(R), {"fwd": 2}, jnp.stack([X, 2 * X]))
