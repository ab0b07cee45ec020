"""A residual that ``bwd`` never reads costs nothing, as with
``jax.custom_vjp``, whose inlined ``bwd`` lets JAX's dead-code elimination
prune what ``fwd`` computes for it. The form of optimistix's solves under
``equinox.internal.while_loop(kind="checkpointed")``: ``fwd`` keeps extra
buffers in its loop's carry that the ``bwd`` it ends up with ignores, and
XLA cannot remove a loop carry on its own (smartvjp did up to 2x the flops
there before ``smartvjp_bwd`` and ``smartvjp_fwd`` had these DCE rules)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import partial_eval as pe   # JAX's own DCE

import smartvjp
from kernels import printed_name

X = jnp.linspace(0.1, 1.0, 16)


def rules(decorator, read_all):
  F = decorator(lambda x: _loop(x)[0])

  def fwd(x):
    y, buffer = _loop(x)
    return y, (jnp.cos(x), buffer)

  def bwd(res, g):
    cos_x, buffer = res
    dx = g * cos_x * 1.5
    return (dx + 0.0 * jnp.sum(buffer) if read_all else dx,)
  F.defvjp(fwd, bwd)
  return F


def _loop(x):
  """``sin`` five times, with a buffer of work in the carry beside it."""
  def body(i, carry):
    y, buf = carry
    return jnp.sin(y) * 1.5, buf + jnp.outer(y, y) @ jnp.outer(y, y)
  return jax.lax.fori_loop(0, 5, body, (x, jnp.zeros((16, 16))))


def _program(F):
  return jax.jit(jax.grad(lambda x: jnp.sum(F(x))))


def _flops(F):
  cost = _program(F).lower(X).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("read_all", [False, True], ids=["ignored", "read"])
def test_a_residual_bwd_ignores_is_not_computed(read_all):
  smart = rules(smartvjp.smart_custom_vjp, read_all)
  anchor = rules(jax.custom_vjp, read_all)
  np.testing.assert_array_equal(_program(smart)(X), _program(anchor)(X))
  assert _flops(smart) <= _flops(anchor)
  if not read_all:   # the buffer's matmuls are gone from both programs
    assert _flops(smart) < _flops(rules(smartvjp.smart_custom_vjp, True))


def test_dce_leaves_fwd_computing_only_what_bwd_reads():
  # JAX's own dead-code elimination, as jit runs it before lowering
  loss = lambda F: jax.value_and_grad(lambda x: jnp.sum(F(x)))
  closed = jax.make_jaxpr(loss(rules(smartvjp.smart_custom_vjp, False)))(X)
  jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True, True])
  eqns = {printed_name(e): e for e in jaxpr.eqns}
  fwd, bwd = eqns["smartvjp_fwd"], eqns["smartvjp_bwd"]
  # the buffer (f32[16,16]) is neither an output of fwd nor an input of bwd;
  # cos(x), which bwd reads, still is
  assert [v.aval.shape for v in fwd.outvars] == [(16,), (16,)], fwd
  assert all(v.aval.shape == (16,) for v in bwd.invars), bwd
  assert fwd.params["fwd"].num_new_res == 1
  # and the pruned equation still evaluates: the same gradient
  got = jax.core.eval_jaxpr(jaxpr, closed.consts, X)
  want = loss(rules(jax.custom_vjp, False))(X)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


def solver_rules(decorator):
  """A solver's form (jaxopt's implicit differentiation through LBFGS): ``f``
  returns its whole state, the caller reads one field, ``bwd`` reads a
  residual; the unread state is a loop carry XLA cannot remove."""
  F = decorator(lambda x: _loop(x))

  def fwd(x):
    y, buffer = _loop(x)
    return (y, buffer), jnp.cos(x)

  def bwd(cos_x, g):
    return (g[0] * cos_x * 1.5,)
  F.defvjp(fwd, bwd)
  return F


def test_a_primal_output_nobody_reads_is_not_computed():
  # JAX's own dead-code elimination, as jit runs it before lowering
  loss = lambda F: jax.value_and_grad(lambda x: jnp.sum(F(x)[0]))
  closed = jax.make_jaxpr(loss(solver_rules(smartvjp.smart_custom_vjp)))(X)
  jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True, True])
  fwd = {printed_name(e): e for e in jaxpr.eqns}["smartvjp_fwd"]
  # the state nobody reads (f32[16,16]) is not an output of fwd, nor
  # computed inside it: no matmul is left in its code
  assert [v.aval.shape for v in fwd.outvars] == [(16,), (16,)], fwd
  assert "dot_general" not in str(fwd.params["jaxpr"]), fwd
  got = jax.core.eval_jaxpr(jaxpr, closed.consts, X)
  want = loss(solver_rules(jax.custom_vjp))(X)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
