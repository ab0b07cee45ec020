"""symbolic_zeros=True exactly as in jax.custom_vjp, also under remat (where
optimize_remat raises NotImplementedError) and inside scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.custom_derivatives import SymbolicZero

from smartvjp import smart_custom_vjp

X = jnp.array([0.3, -1.2, 2.0], jnp.float32)
W = jnp.array([1.5, 0.5, -1.0], jnp.float32)


def make(cls, log):
  def f(x, w):
    return jnp.sin(x) * w, jnp.cos(x)

  def fwd(x, w):
    log.append(("fwd", x.perturbed, w.perturbed))
    assert isinstance(x, jax.custom_derivatives.CustomVJPPrimal)
    res = (jnp.cos(x.value), jnp.sin(x.value), w.value)
    if not w.perturbed:   # residual structure depends on perturbation
      res = res[:2] + (w.value, jnp.float32(0))
    return f(x.value, w.value), res

  def bwd(res, g):
    gy, gc = g
    log.append(("bwd", type(gy) is SymbolicZero, type(gc) is SymbolicZero))
    c, s, w = res[:3]
    dx = jnp.zeros_like(c) if type(gy) is SymbolicZero else c * w * gy
    if type(gc) is not SymbolicZero:
      dx = dx - s * gc
    dw = None if type(gy) is SymbolicZero else s * gy
    return dx, dw

  F = cls(f)
  F.defvjp(fwd, bwd, symbolic_zeros=True)
  return F


def reference_grads(ad_mode, grad_of, args, log):
  """``jax.custom_vjp``'s gradients; under remat3, where some JAX releases
  fail on symbolic zeros inside a checkpoint (0.11.2: "RematTracer has no
  attribute perturbed"), the plain function's, and ``log`` is cleared so that
  no rule log is compared."""
  try:
    return grad_of(make(jax.custom_vjp, log))(*args)
  except AttributeError:
    if ad_mode != "remat3":
      raise
    log.clear()
    return grad_of(lambda x, w: (jnp.sin(x) * w, jnp.cos(x)))(*args)


def _expected_rule_log(ad_mode, remat, argnums):
  """``(w_perturbed, bwd_sees_symbolic_zero)``. Under remat3, JAX's rule for
  a checkpointed ``jax.custom_vjp`` tells ``fwd`` that every argument is
  perturbed (it cannot know yet which ones the backward pass differentiates),
  and smartvjp's rule tells ``fwd`` the same; on jax 0.11 JAX's checkpoint
  also instantiates the unused output's zero cotangent before any rule sees
  it, so ``bwd`` gets no ``SymbolicZero`` there (the log comparison with
  ``jax.custom_vjp`` above checks both)."""
  if ad_mode == "remat3" and remat:
    version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    return True, version != (0, 11)
  return 1 in argnums, True


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
@pytest.mark.parametrize("argnums", [(0,), (0, 1)])
def test_perturbed_flags_and_symbolic_cotangents(ad_mode, remat, argnums):
  ls, lr = [], []
  s = make(smart_custom_vjp, ls)

  def loss(F):
    G = jax.checkpoint(F) if remat else F
    return lambda x, w: jnp.sum(G(x, w)[0] ** 2)   # second output unused

  grad_of = lambda F: jax.jit(jax.grad(loss(F), argnums))
  gs = grad_of(s)(X, W)
  gr = reference_grads(ad_mode, grad_of, (X, W), lr)
  for a, b in zip(gs, gr):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  if lr:
    assert set(ls) == set(lr)
  w_perturbed, zero_seen = _expected_rule_log(ad_mode, remat, argnums)
  # the unused output's cotangent reaches bwd as a SymbolicZero
  assert (("bwd", False, True) in ls) == zero_seen
  # w is perturbed only if differentiated (default path)
  assert ("fwd", True, w_perturbed) in ls


def test_symbolic_zeros_inside_scan(ad_mode):
  ls, lr = [], []
  s = make(smart_custom_vjp, ls)

  def loss(F):
    def body(c, w):
      y, _ = jax.checkpoint(F)(c, w)
      return y, None
    return lambda x, ws: jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

  ws = jnp.stack([W, W * 0.5])
  for argnums in [(0,), (0, 1)]:
    grad_of = lambda F: jax.jit(jax.grad(loss(F), argnums))
    gs = grad_of(s)(X, ws)
    gr = reference_grads(ad_mode, grad_of, (X, ws), lr)
    for a, b in zip(gs, gr):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_optimize_remat_refuses_symbolic_zeros():
  with pytest.raises(NotImplementedError):
    make(lambda f: _opt(f), [])


def _opt(f):
  class Opt:
    def __init__(self, f):
      self.F = jax.custom_vjp(f)

    def defvjp(self, fwd, bwd, symbolic_zeros):
      self.F.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros,
                    optimize_remat=True)
  return Opt(f)


def test_custom_vjp_primal_tree_values_in_fwd():
  @smart_custom_vjp
  def f(p):
    return p["a"] * 2.0

  def fwd(p):
    vals = jax.custom_derivatives.custom_vjp_primal_tree_values(p)
    return f(vals), None

  f.defvjp(fwd, lambda _, g: ({"a": 2.0 * g},), symbolic_zeros=True)
  assert jax.grad(lambda a: f({"a": a}))(1.0) == 2.0
