"""Control flow: scan (with unroll), fori_loop, cond/switch, remat inside scan
and scan inside remat, checkpoint static_argnums and prevent_cse=False."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
from smartvjp import smart_custom_vjp

X = jnp.array([0.3, -1.2, 2.0], jnp.float32)


def build():
  f, fwd, bwd, _ = K.sin_rules()
  s = smart_custom_vjp(f)
  s.defvjp(fwd, bwd)
  r = jax.custom_vjp(f)
  r.defvjp(fwd, bwd)
  return s, r


def check(prog, expected=None):
  s, r = build()
  K.reset()
  out = jax.block_until_ready(jax.jit(jax.grad(prog(s)))(X))
  counts = dict(K.COUNTS)
  ref = jax.jit(jax.grad(prog(r)))(X)
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)
  if expected is not None:
    assert counts == expected
  return counts


@pytest.mark.parametrize("unroll", [1, 2, True])
def test_scan_with_unroll(ad_mode, unroll):
  def prog(F):
    def body(c, _):
      return jax.checkpoint(F)(c), None
    return lambda x: jnp.sum(jax.lax.scan(body, x, None, length=4,
                                          unroll=unroll)[0] ** 2)
  check(prog, {"f": 4, "fwd": 4, "bwd": 4})


def test_fori_loop(ad_mode):
  def prog(F):
    return lambda x: jnp.sum(jax.lax.fori_loop(
        0, 3, lambda i, c: jax.checkpoint(F)(c), x) ** 2)
  check(prog, {"f": 3, "fwd": 3, "bwd": 3})


@pytest.mark.parametrize("pred", [True, False])
def test_cond_with_call_in_one_branch(ad_mode, pred):
  def prog(F):
    return lambda x: jnp.sum(jax.lax.cond(
        pred, jax.checkpoint(F), lambda x: x * 2.0, x) ** 2)
  counts = check(prog)
  # the callback in the untaken branch never runs
  assert counts == ({"f": 1, "fwd": 1, "bwd": 1} if pred else {})


def test_switch(ad_mode):
  def prog(F):
    return lambda x: jnp.sum(jax.lax.switch(
        1, [lambda x: x, jax.checkpoint(F), lambda x: -x], x) ** 2)
  check(prog, {"f": 1, "fwd": 1, "bwd": 1})


def test_scan_inside_remat(ad_mode):
  def prog(F):
    def body(c, _):
      return F(c), None
    inner = jax.checkpoint(lambda x: jax.lax.scan(body, x, None, length=3)[0])
    return lambda x: jnp.sum(inner(x) ** 2)
  check(prog, {"f": 3, "fwd": 3, "bwd": 3})


def test_remat_inside_scan_inside_remat(ad_mode):
  def prog(F):
    def body(c, _):
      return jax.checkpoint(F)(c), None
    outer = jax.checkpoint(lambda x: jax.lax.scan(body, x, None, length=2)[0])
    return lambda x: jnp.sum(outer(x) ** 2)
  counts = check(prog)
  assert counts["bwd"] == 2 and counts["fwd"] == 2 and "fwd_bwd" not in counts


def test_checkpoint_static_argnums_and_prevent_cse(ad_mode):
  def prog(F):
    @functools.partial(jax.checkpoint, static_argnums=(1,), prevent_cse=False)
    def layer(x, n):
      for _ in range(n):
        x = F(x)
      return x
    return lambda x: jnp.sum(layer(x, 2) ** 2)
  check(prog, {"f": 2, "fwd": 2, "bwd": 2})


def test_while_loop_primal():
  s, r = build()
  loop = lambda F: (lambda x: jax.lax.while_loop(
      lambda c: c[1] < 3, lambda c: (F(c[0]), c[1] + 1), (x, 0))[0])
  K.reset()
  np.testing.assert_allclose(jax.jit(loop(s))(X), jax.jit(loop(r))(X), rtol=1e-6)
