"""``smartvjp.import_swapped`` on the real libraries of ``tests/ports``, in
this process: the swapped copy's values and gradients are bit for bit those
of the library as installed (which stays unswapped beside it), and its
programs hold smartvjp's primitives where the library's hold JAX's.

(The other files here run each library's program twice in fresh processes,
importing the library inside ``smartvjp.swap_custom_vjp()``.) diffrax is not
copied: it is built on equinox, lineax and optimistix, and a second copy of
equinox's classes beside the first is not something that stack supports;
``swap_custom_vjp()`` around its first import is the way there
(``test_diffrax.py``)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartvjp


def assert_bitwise(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb) and la
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes(), (x, y)


def schedule(fn, *args):
  """(smartvjp's primitives, JAX's custom_vjp_call) in fn's jaxpr."""
  text = str(jax.make_jaxpr(lambda *a: fn(*a))(*args))
  return "smartvjp_" in text, "custom_vjp_call" in text


def copies(name, **kw):
  shared = importlib.import_module(name)
  copy = smartvjp.import_swapped(name, **kw)
  assert importlib.import_module(name) is shared
  return shared, copy


def test_odeint():
  pytest.importorskip("jax.experimental.ode")
  shared, copy = copies("jax.experimental.ode")
  assert smartvjp.swap_report(copy)["jax.experimental.ode._odeint"]
  ts = jnp.linspace(0.0, 1.0, 4)

  def loss(ode):
    def f(y0, a):
      ys = ode.odeint(lambda y, t, a: jnp.stack([a * y[1], -jnp.sin(y[0])]),
                      y0, ts, a, rtol=1e-5, atol=1e-5)
      return jnp.sum(ys ** 2)
    return f
  y0, a = jnp.array([0.8, -0.3]), jnp.float32(1.1)
  assert schedule(jax.checkpoint(loss(copy)), y0, a) == (True, False)
  assert schedule(jax.checkpoint(loss(shared)), y0, a) == (False, True)
  assert_bitwise(*[jax.jit(jax.grad(jax.checkpoint(loss(m)), (0, 1)))(y0, a)
                   for m in (shared, copy)])
  batched = [jax.jit(jax.vmap(jax.grad(jax.checkpoint(loss(m))), (0, None)))(
      jnp.stack([y0, -y0]), a) for m in (shared, copy)]
  assert_bitwise(*batched)


def test_optax_scale_gradient():
  pytest.importorskip("optax")
  shared, copy = copies("optax")
  assert smartvjp.swap_report(copy)["optax._src.utils._scale_gradient"]
  assert not smartvjp.swap_report(shared)["optax._src.utils._scale_gradient"]

  def loss(optax):
    def layer(c, w):
      return optax.scale_gradient(jnp.tanh(c @ w), 0.5), None
    return lambda ws, x: jnp.sum(
        jax.lax.scan(jax.checkpoint(layer), x, ws)[0] ** 2)
  ws = jax.random.normal(jax.random.key(0), (3, 4, 4))
  x = jax.random.normal(jax.random.key(1), (2, 4))
  assert schedule(loss(copy), ws, x) == (True, False)
  assert schedule(loss(shared), ws, x) == (False, True)
  assert_bitwise(*[jax.jit(jax.grad(loss(m)))(ws, x) for m in (shared, copy)])


def test_flax_fp8_dot_general():
  pytest.importorskip("flax")
  import flax.linen as nn
  shared, copy = copies("flax.linen.fp8_ops")
  report = smartvjp.swap_report(copy)
  assert report["flax.linen.fp8_ops.quantized_dot"] and all(report.values())

  def run(fp8_ops):
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.Dense(8, dot_general_cls=fp8_ops.Fp8DotGeneral)(x)
        return nn.Dense(4, dot_general_cls=fp8_ops.Fp8DotGeneral)(
            jax.nn.gelu(h))
    net, x = Net(), jax.random.normal(jax.random.key(1), (8, 8))
    variables = net.init(jax.random.key(2), x)
    meta = "_overwrite_with_gradient"
    loss = lambda p, m: jnp.mean(net.apply({"params": p, meta: m}, x) ** 2)
    args = (variables["params"], variables[meta])
    return (schedule(jax.checkpoint(loss), *args),
            jax.jit(jax.value_and_grad(loss, (0, 1)))(*args))
  (theirs, want), (ours, got) = run(shared), run(copy)
  assert (theirs, ours) == ((False, True), (True, False))
  assert_bitwise(want, got)
