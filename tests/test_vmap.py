"""vmap: batching rules for every smartvjp primitive, compared with
jax.custom_vjp, with per-example kernel counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
from smartvjp import smart_custom_vjp

B, N = 3, 4
X = jnp.linspace(-1.0, 1.0, B * N, dtype=jnp.float32).reshape(B, N)
W = jnp.linspace(0.5, 2.0, N, dtype=jnp.float32)


def build(fused=None):
  f, fwd, bwd, fb = K.xw_rules()
  s = smart_custom_vjp(f)
  if fused == "only":
    s.defvjp(fwd_bwd=fb)
  else:
    s.defvjp(fwd, bwd, fwd_bwd=fb if fused == "also" else None)
  r = jax.custom_vjp(f)
  r.defvjp(fwd, bwd)
  return s, r


def run(fn, *args):
  K.reset()
  out = jax.block_until_ready(fn(*args))
  return out, dict(K.COUNTS)


def same(fs, fr, *args):
  out_s, counts = run(fs, *args)
  out_r, _ = run(fr, *args)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
      out_s, out_r)
  return counts


def test_vmap_primal_in_axes_out_axes():
  s, r = build()
  fs = jax.vmap(s, in_axes=(1, None), out_axes=1)
  fr = jax.vmap(r, in_axes=(1, None), out_axes=1)
  assert same(fs, fr, X.T, W) == {"f": B}


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_vmap_outside_grad_unbatched_weight(linearize_mode, remat):
  s, r = build()

  def per_example(F):
    G = jax.checkpoint(F) if remat else F
    return jax.vmap(jax.grad(lambda x, w: jnp.sum(G(x, w) ** 2), (0, 1)),
                    in_axes=(0, None))

  counts = same(jax.jit(per_example(s)), jax.jit(per_example(r)), X, W)
  expected = {"fwd": B, "bwd": B}
  if remat:
    expected["f"] = B
  assert counts == expected


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_vmap_inside_grad_sums_weight_cotangent(linearize_mode, remat):
  s, r = build()

  def batched_loss(F):
    G = jax.checkpoint(F) if remat else F
    return lambda x, w: jnp.sum(jax.vmap(G, in_axes=(0, None))(x, w) ** 2)

  counts = same(jax.jit(jax.grad(batched_loss(s), (0, 1))),
                jax.jit(jax.grad(batched_loss(r), (0, 1))), X, W)
  expected = {"fwd": B, "bwd": B}
  if remat:
    expected["f"] = B
  assert counts == expected


def test_checkpoint_of_vmap_and_nonzero_axes(linearize_mode):
  s, r = build()

  def loss(F):
    G = jax.checkpoint(jax.vmap(F, in_axes=(1, None), out_axes=1))
    return lambda x, w: jnp.sum(G(x, w) ** 2)

  counts = same(jax.jit(jax.grad(loss(s), (0, 1))),
                jax.jit(jax.grad(loss(r), (0, 1))), X.T, W)
  assert counts == {"f": B, "fwd": B, "bwd": B}


def test_vmap_of_scan_of_checkpointed_layer(linearize_mode):
  s, r = build()

  def loss(F):
    def body(c, _):
      return jax.checkpoint(F)(c, W), None
    return lambda x: jnp.sum(jax.lax.scan(body, x, None, length=2)[0] ** 2)

  counts = same(jax.jit(jax.vmap(jax.grad(loss(s)))),
                jax.jit(jax.vmap(jax.grad(loss(r)))), X)
  assert counts == {"f": 2 * B, "fwd": 2 * B, "bwd": 2 * B}


@pytest.mark.parametrize("fused", ["also", "only"])
def test_vmap_fused_rule(linearize_mode, fused):
  s, r = build(fused)

  def loss(F):
    return lambda x, w: jnp.sum(
        jax.vmap(jax.checkpoint(F), in_axes=(0, None))(x, w) ** 2)

  counts = same(jax.jit(jax.grad(loss(s), (0, 1))),
                jax.jit(jax.grad(loss(r), (0, 1))), X, W)
  assert counts == {"f": B, "fwd_bwd": B}


def test_vmap_of_jax_coded_rules_with_pytrees():
  def fun(p, x):
    return {"y": jnp.tanh(p["a"] * x + p["b"])}

  def fwd(p, x):
    y = fun(p, x)
    return y, (p, x, y["y"])

  def bwd(res, g):
    p, x, y = res
    d = g["y"] * (1 - y ** 2)
    return {"a": jnp.sum(d * x), "b": jnp.sum(d)}, d * p["a"]

  s = smart_custom_vjp(fun)
  s.defvjp(fwd, bwd)
  ref = lambda p, x: fun(p, x)
  p = {"a": jnp.float32(1.5), "b": jnp.float32(-0.2)}
  loss = lambda F: (lambda p, x: jnp.sum(jax.vmap(
      jax.checkpoint(F), in_axes=(None, 0))(p, x)["y"] ** 2))
  gs = jax.jit(jax.grad(loss(s), (0, 1)))(p, X)
  gr = jax.jit(jax.grad(loss(ref), (0, 1)))(p, X)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), gs, gr)
