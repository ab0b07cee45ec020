"""A JAX-coded ``fwd`` built around ``while_loop`` solves (qpax's
``solve_qp_primal``: ``f`` a solve, ``fwd`` the solve then a refining
re-solve, Python-number options as trailing arguments): under
``jax.checkpoint`` the forward pass runs ``f``, as the contract says.

JAX's partial evaluator keeps a ``while_loop``'s inputs as residuals whatever
the policy says (a loop cannot save what it computes inside); splitting such
a ``fwd`` by the policy therefore "saved" the loop's inputs computed before
it, and the forward pass ran ``fwd``'s first solve instead of ``f``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import kernels as K
from smartvjp import smart_custom_vjp


def _solve(a, q, x0, tol):
  # gradient iterations on 0.5 x'Mx - q'x, M = a a'/n + 1, until the
  # residual is below tol; a is read inside the loop, as qpax's matrices are
  def cond(c):
    x, i = c
    return (jnp.linalg.norm(_apply(a, x) - q) > tol) & (i < 200)

  def body(c):
    x, i = c
    return x - 0.2 * (_apply(a, x) - q), i + 1
  return jax.lax.while_loop(cond, body, (x0, 0))[0]


def _apply(a, x):
  return a @ (a.T @ x) / a.shape[1] + x


def build(cls):
  # as qpax does, the inputs pass through jnp.atleast_2d (an identity jit)
  # before the loops read them, and the options are trailing numbers
  def f(a, q, tol=1e-4):
    q = K.kernel("f", lambda q: (q,), (q,), q)[0]
    return _solve(jnp.atleast_2d(a), q, jnp.zeros_like(q), tol)

  def fwd(a, q, tol=1e-4):
    q = K.kernel("fwd", lambda q: (q,), (q,), q)[0]
    a2 = jnp.atleast_2d(a)
    x = _solve(a2, q, jnp.zeros_like(q), tol)
    xr = _solve(a2, q, x, tol / 100)        # the refining re-solve
    return x, (a, xr)

  def bwd(res, g):
    a, xr = res
    m = a @ a.T / a.shape[1] + jnp.eye(a.shape[0])
    dq = jnp.linalg.solve(m, g)
    dm = -jnp.outer(dq, xr)
    da = (dm + dm.T) @ a / a.shape[1]
    return da, dq, None

  F = cls(f)
  F.defvjp(fwd, bwd)
  return F


A = jnp.asarray(np.random.RandomState(0).randn(5, 5) / 2, jnp.float32)
Q = jnp.asarray(np.random.RandomState(1).randn(5), jnp.float32)


def loss(F):
  return lambda a, q: jnp.sum(jax.checkpoint(F)(a, q) ** 2)


@pytest.mark.parametrize("jit", [True, False])
def test_f_runs_forward_under_checkpoint(jit):
  grad = jax.grad(loss(build(smart_custom_vjp)), argnums=(0, 1))
  ref = jax.grad(loss(build(jax.custom_vjp)), argnums=(0, 1))
  if jit:
    grad, ref = jax.jit(grad), jax.jit(ref)
  got, counts = K.run(grad, A, Q)
  want, ref_counts = K.run(ref, A, Q)
  assert ref_counts == {"fwd": 2}
  assert counts == {"f": 1, "fwd": 1}
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


def test_forward_pass_saves_no_computed_value():
  # the inputs and what the loss computes from the primal output, nothing
  # of the rules (before: the matrix the loops read, "output of smartvjp_rule")
  saved = saved_residuals(loss(build(smart_custom_vjp)), A, Q)
  assert sorted(s[1].split(" from")[0] for s in saved) == [
      "from the argument a", "from the argument q", "output of mul"], saved


HEAVY = ("dot_general", "cholesky", "triangular_solve", "lapack")


def heavy_ops(fn, *args):
  """How many matrix products and factorizations the lowered program holds
  (its StableHLO text, where the rules' jaxprs are inlined)."""
  text = jax.jit(fn).lower(*args).as_text()
  return {h: len(re.findall(h, text)) for h in HEAVY}


@pytest.mark.parametrize("remat", [False, True])
def test_scan_no_more_heavy_operations_than_jax(remat):
  def scanned(F):
    F = jax.checkpoint(F) if remat else F
    def step(c, _):
      return F(A, c) * 0.5 + c, None
    return jax.grad(lambda q: jnp.sum(jax.lax.scan(step, q, None, length=2)[0] ** 2))

  got = heavy_ops(scanned(build(smart_custom_vjp)), Q)
  want = heavy_ops(scanned(build(jax.custom_vjp)), Q)
  assert got["dot_general"] > 0
  assert all(got[h] <= want[h] for h in HEAVY), (got, want)
  np.testing.assert_array_equal(jax.jit(scanned(build(smart_custom_vjp)))(Q),
                                jax.jit(scanned(build(jax.custom_vjp)))(Q))
