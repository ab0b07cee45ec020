"""Issue 70: drop-in differences the differential fuzzer found under JAX's
remat3 flags (``jax_remat3`` + ``jax_custom_vjp3``), each compared with
``jax.custom_vjp`` given the same rules under the same flags."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
from smartvjp import _versions as V
from smartvjp import smart_custom_vjp

FLAGS = ("jax_remat3", "jax_custom_vjp3")
# before jax 0.11.1 JAX's own remat3 differs from its later releases in these
# programs (0.10.2 refuses the hessians with its forward-mode TypeError and
# gives the mean below): there the reference is jax.custom_vjp without the
# checkpoint, which the checkpoint must not change
JAX_REMAT3_IS_REFERENCE = not V.REMAT3_PERTURBS_EVERY_INPUT
OLD_REMAT3 = ("jax 0.10's remat3 perturbs every input of the checkpoint, and "
              "JAX refuses these hessians (its forward-mode TypeError); there "
              "smartvjp batches the forward pass's primal as the call, whose "
              "derivative is the rule's (test_remat3's straight-through floor)")
X = jnp.array([0.3, -1.2, 2.0], jnp.float32)

pytestmark = pytest.mark.skipif(
    not all(K.has_flag(f) for f in FLAGS),
    reason="jax_remat3 and jax_custom_vjp3 first appear in jax 0.10.1")


@pytest.fixture(autouse=True)
def _flags():
  with K.config(**{f: True for f in FLAGS}):
    yield


# -- a fwd_bwd-only call: second order in an input the rule holds fixed --------

def _held_fixed():
  """``F(x, s) = sin(x) * s``; the rules return 0 as ``s``'s cotangent (a
  "hold it fixed" rule, not ``f``'s VJP in ``s``)."""
  def f(x, s):
    return jnp.sin(x) * s

  def fwd_bwd(x, s, g):
    return jnp.cos(x) * s * g, jnp.zeros_like(s)

  def fwd(x, s):
    return f(x, s), (x, s)

  def bwd(res, g):
    return fwd_bwd(*res, g)
  smart = smart_custom_vjp(f)
  smart.defvjp(fwd_bwd=fwd_bwd)
  ref = jax.custom_vjp(f)
  ref.defvjp(fwd, bwd)
  return smart, ref


@pytest.mark.parametrize("order", ["rev_rev", "fwd_rev"])
@pytest.mark.parametrize("form", ["x*s, s", "s, s"])
def test_second_order_in_a_held_fixed_input_differentiates_f(order, form):
  """The primal output the forward pass computes is differentiated as
  ``f``'s code (JAX runs ``fwd``, ``f`` saving its inputs, there), not by
  the rule: smartvjp gave the mean of the two (0.5218 against 1.0437 in
  the fuzzer's program)."""
  S, R = _held_fixed()

  def loss(F, remat=True):
    def scalar(s):
      a = X * s if form == "x*s, s" else s * jnp.ones_like(X)
      return jnp.sum((jax.checkpoint(F) if remat else F)(a, s) ** 2)
    return scalar
  outer = jax.grad if order == "rev_rev" else jax.jacfwd
  got = outer(jax.grad(loss(S)))(1.5)
  # jax.custom_vjp's value without the checkpoint: the checkpoint changes
  # no value (JAX's own remat3 gives it from 0.11; 0.10's gives the mean)
  want = outer(jax.grad(loss(R, remat=False)))(1.5)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  if JAX_REMAT3_IS_REFERENCE:
    np.testing.assert_allclose(got, outer(jax.grad(loss(R)))(1.5), rtol=1e-6)
  # and the rule's 0 did matter: the plain function's value is another
  plain = outer(jax.grad(loss(lambda x, s: jnp.sin(x) * s)))(1.5)
  assert not np.allclose(got, plain, rtol=1e-3)


# -- jax.hessian of a checkpoint: a constant f closes over -----------------------

CONST = np.array([1.5, 0.5, 2.0], np.float32)


def _with_constant(k, how, rules):
  """``f(x) = sin(x) * k``, ``k`` closed over or a ``nondiff_argnums``
  argument; ``(smart, jax.custom_vjp, apply)``."""
  if how == "closure":
    def f(x):
      return jnp.sin(x) * k

    def fwd(x):
      return f(x), (x,)

    def bwd(res, g):
      return (jnp.cos(res[0]) * k * g,)

    def fwd_bwd(x, g):
      return (jnp.cos(x) * k * g,)
    kw = {}
    apply = lambda F, x: F(x)
  else:
    def f(c, x):
      return jnp.sin(x) * c

    def fwd(c, x):
      return f(c, x), (x,)

    def bwd(c, res, g):
      return (jnp.cos(res[0]) * c * g,)

    def fwd_bwd(c, x, g):
      return (jnp.cos(x) * c * g,)
    kw = dict(nondiff_argnums=(0,))
    apply = lambda F, x: F(k, x)
  smart = smart_custom_vjp(f, **kw)
  if rules == "fwd_bwd":
    smart.defvjp(fwd_bwd=fwd_bwd)
  else:
    smart.defvjp(fwd, bwd)
  ref = jax.custom_vjp(f, **kw)
  ref.defvjp(fwd, bwd)
  return smart, ref, apply


@pytest.mark.parametrize("rules", ["fwd+bwd", "fwd_bwd"])
@pytest.mark.parametrize("how", ["closure", "nondiff_argnums"])
@pytest.mark.parametrize("kind", ["numpy", "jnp"])
def test_hessian_of_a_checkpoint_with_a_constant(kind, how, rules):
  """smartvjp raised ``CustomVJPException`` (a closed-over value
  differentiated): remat3's JVP gives the checkpoint's every input a zero
  tangent, and a ``vmap`` (``jacfwd``) had made the forward pass's
  ``smartvjp_primal`` a ``smartvjp_call``, whose derivative is the rule's."""
  if not JAX_REMAT3_IS_REFERENCE:
    pytest.skip(OLD_REMAT3)
  k = CONST if kind == "numpy" else jnp.asarray(CONST)
  S, R, apply = _with_constant(k, how, rules)

  def loss(F, remat=True):
    fn = lambda x: jnp.sum(apply(F, x) ** 2)
    return jax.checkpoint(fn) if remat else fn
  got = jax.hessian(loss(S))(X)
  np.testing.assert_allclose(got, jax.hessian(loss(R, False))(X),
                             rtol=1e-6, atol=1e-6)
  if JAX_REMAT3_IS_REFERENCE:
    np.testing.assert_allclose(got, jax.hessian(loss(R))(X), rtol=1e-6,
                               atol=1e-6)


def test_hessian_of_a_checkpoint_differentiates_fwd_when_it_differs_from_f():
  """The batched forward pass keeps ``fwd``'s primal outputs as the
  derivative (a straight-through ``fwd``: ``f`` rounds, ``fwd`` does not)."""
  def f(x):
    return jnp.round(x * 4.0) * jnp.sin(x) * CONST

  def fwd(x):
    return x * 4.0 * jnp.sin(x) * CONST, (x,)

  def bwd(res, g):
    x, = res
    return ((4.0 * jnp.sin(x) + 4.0 * x * jnp.cos(x)) * CONST * g,)
  if not JAX_REMAT3_IS_REFERENCE:
    pytest.skip(OLD_REMAT3)
  S = smart_custom_vjp(f)
  S.defvjp(fwd, bwd)
  R = jax.custom_vjp(f)
  R.defvjp(fwd, bwd)

  def loss(F, remat=True):
    fn = lambda x: jnp.sum(F(x) ** 2)
    return jax.checkpoint(fn) if remat else fn
  got = jax.hessian(loss(S))(X)
  np.testing.assert_allclose(got, jax.hessian(loss(R, False))(X), rtol=1e-5,
                             atol=1e-5)
  if JAX_REMAT3_IS_REFERENCE:
    np.testing.assert_allclose(got, jax.hessian(loss(R))(X), rtol=1e-5,
                               atol=1e-5)


# -- a fwd whose primal output is not f's (seeds 6800123, 6800851) -------------

@pytest.mark.parametrize("how", ["vjp", "grad", "jit(vjp)"])
def test_fwd_returning_another_structure_is_refused_as_by_custom_vjp3(how):
  """``jax_custom_vjp3`` traces ``f`` and refuses a ``fwd`` whose primal
  output has another structure with a ``TypeError``; smartvjp, which had not
  traced ``f`` where the call is differentiated where made, returned
  ``fwd``'s tuple."""
  def f(x):
    return jnp.sin(x)

  def fwd(x):
    return (jnp.sin(x), jnp.sin(x)), jnp.cos(x)

  def bwd(c, g):
    return (g * c,)
  run = {"vjp": lambda F: jax.vjp(F, X)[0],
         "grad": lambda F: jax.grad(lambda x: jnp.sum(F(x)))(X),
         "jit(vjp)": jax.jit(lambda F: jax.vjp(F, X)[0], static_argnums=0)}
  R = jax.custom_vjp(f)
  R.defvjp(fwd, bwd)
  with pytest.raises(TypeError):
    run[how](R)
  S = smart_custom_vjp(f)
  S.defvjp(fwd, bwd)
  with pytest.raises(TypeError, match="fwd rule fwd .* pytree structure "
                     "differs from f's output"):
    run[how](S)
