"""``smartvjp.print_schedule``: one line per rule equation of a program,
with ``which`` and ``part`` read from the equation's params (``part`` is
one), where it is nested and how often it repeats. Its agreement with
``RunCounter`` on the contract's rows is in ``tests/test_run_counter.py``."""

import jax
import jax.numpy as jnp

import smartvjp
from smartvjp import smart_custom_vjp

X = jnp.linspace(-1.0, 1.0, 4 * 8).reshape(4, 8)
W = jnp.linspace(0.5, -0.5, 8 * 8).reshape(8, 8)
DOTS = jax.checkpoint_policies.dots_saveable


def gelu_layer():
  """matmul + GELU whose residual is GELU's derivative at the matmul: under
  dots_saveable the matmul is saved, the derivative recomputed backward."""
  dgelu = lambda y: jax.vmap(jax.grad(jax.nn.gelu))(y.ravel()).reshape(y.shape)
  F = smart_custom_vjp(lambda x, w: jax.nn.gelu(x @ w))

  def fwd(x, w):
    y = x @ w
    return jax.nn.gelu(y), (x, w, dgelu(y))

  def bwd(res, g):
    x, w, d = res
    return (g * d) @ w.T, x.T @ (g * d)
  F.defvjp(fwd, bwd)
  return F


def test_a_split_fwd_shows_both_parts_from_the_param(capsys, ad_mode):
  F = gelu_layer()
  step = jax.grad(lambda x, w: jnp.sum(jax.checkpoint(F, policy=DOTS)(x, w) ** 2),
                  (0, 1))
  rules = smartvjp.print_schedule(step, X, W)
  assert [(r.which, r.part) for r in rules] == [
      ("fwd", "saved"), ("fwd", "rest"), ("bwd", None)]
  assert [r.equation.params["part"] for r in rules[:2]] == ["saved", "rest"]
  assert rules[0].where == ()
  if ad_mode == "default":   # under remat3, RematTraced (jax 0.12) or inlined
    assert rules[1].where == ("remat2",)
  assert rules[0].rule == "fwd" and rules[0].function == "<lambda>"
  printed = capsys.readouterr().out.splitlines()
  assert printed == [str(r) for r in rules]
  assert printed[0].startswith("fwd[part=saved] (fwd) of <lambda>")
  assert printed[1].startswith("fwd[part=rest] (fwd) of <lambda>")
  # the jaxpr prints the same param, however its lines wrap
  assert "part=rest" in str(rules[1].equation)


def test_repeats_in_scan_and_while_and_nothing_to_show(capsys):
  F = gelu_layer()
  layer = lambda x: jax.checkpoint(F)(x, W)
  scanned = lambda x: jnp.sum(jax.lax.scan(
      lambda c, _: (layer(c), None), x, None, length=3)[0])
  rules = smartvjp.print_schedule(jax.grad(scanned), X)
  assert [r.which for r in rules] == ["f", "fwd", "bwd"]
  assert {r.repeats for r in rules} == {3} and "x3" in str(rules[0])
  looped = lambda x: jax.lax.while_loop(lambda c: c[1] < 2,
                                        lambda c: (F(c[0], W), c[1] + 1),
                                        (x, 0))[0]
  rules = smartvjp.print_schedule(looped, X)
  assert [(r.which, r.repeats) for r in rules] == [("f", None)]
  assert "x?" in str(rules[0])
  capsys.readouterr()
  assert smartvjp.print_schedule(jnp.sin, X) == []
  assert "no smartvjp rule equations" in capsys.readouterr().out


def test_forward_mode_shows_the_jvp_equation():
  F = gelu_layer()
  rules = smartvjp.print_schedule(lambda x, t: jax.jvp(lambda x: F(x, W),
                                                        (x,), (t,)), X, X)
  assert [r.which for r in rules] == ["jvp"] and rules[0].rule is None
