"""The forward rule ``defvjp(..., jvp=...)``: forward mode runs it instead of
transposing ``bwd``; reverse mode never runs it.

Values are compared with JAX's own forward mode of the plain function;
kernel runs are counted with ``jax.pure_callback`` kernels (tests/kernels.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.custom_derivatives import SymbolicZero

import kernels as K
from smartvjp import smart_custom_vjp

X = jnp.array([0.3, -1.2, 2.0], jnp.float32)
T = jnp.array([1.0, 0.5, -2.0], jnp.float32)
XS = jnp.stack([X, X + 1.0])
TS = jnp.stack([T, 2.0 * T])


def sin_jvp(primals, tangents):
  """sin's forward rule: the primal and the tangent as two kernels, so that
  a program needing only the tangent can leave the first out."""
  (x,), (t,) = primals, tangents
  (y,) = K.kernel("jvp_f", lambda x: (np.sin(x),), [x], x)
  (dy,) = K.kernel("jvp_t", lambda x, t: (np.cos(x) * t,), [x], x, t)
  return y, dy


def smart_sin(rules, jvp=sin_jvp):
  f, fwd, bwd, fwd_bwd = K.sin_rules()
  F = smart_custom_vjp(f)
  if rules == "fwd, bwd":
    F.defvjp(fwd, bwd, jvp=jvp)
  elif rules == "fwd_bwd":
    F.defvjp(fwd_bwd=fwd_bwd, jvp=jvp)
  else:
    F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd, jvp=jvp)
  return F


FORWARD = {
    "jvp": lambda F: jax.jvp(F, (X,), (T,)),
    "jit(jvp)": lambda F: jax.jit(lambda x, t: jax.jvp(F, (x,), (t,)))(X, T),
    "jvp(jit)": lambda F: jax.jvp(jax.jit(F), (X,), (T,)),
    "jvp(checkpoint)": lambda F: jax.jvp(jax.checkpoint(F), (X,), (T,)),
    "jvp(vmap)": lambda F: jax.jvp(jax.vmap(F), (XS,), (TS,)),
    "vmap(jvp)": lambda F: jax.vmap(lambda x, t: jax.jvp(F, (x,), (t,)))(XS,
                                                                        TS),
    "jvp(scan)": lambda F: jax.jvp(lambda x: jax.lax.scan(
        lambda c, _: (F(c), None), x, None, length=2)[0], (X,), (T,)),
}
# which kernels each program runs (with any of the three rule sets)
FORWARD_COUNTS = {
    "jvp": {"jvp_f": 1, "jvp_t": 1},
    "jit(jvp)": {"jvp_f": 1, "jvp_t": 1},
    "jvp(jit)": {"jvp_f": 1, "jvp_t": 1},
    "jvp(checkpoint)": {"jvp_f": 1, "jvp_t": 1},
    "jvp(vmap)": {"jvp_f": 2, "jvp_t": 2},
    "vmap(jvp)": {"jvp_f": 2, "jvp_t": 2},
    "jvp(scan)": {"jvp_f": 2, "jvp_t": 2},
}
RULE_SETS = ["fwd, bwd", "fwd_bwd", "all three"]


def _close(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rules", RULE_SETS)
@pytest.mark.parametrize("program", sorted(FORWARD))
def test_forward_mode_runs_the_forward_rule_only(rules, program):
  out, counts = K.run(FORWARD[program], smart_sin(rules))
  _close(out, FORWARD[program](jnp.sin))
  assert counts == FORWARD_COUNTS[program]


@pytest.mark.parametrize("rules", RULE_SETS)
@pytest.mark.parametrize("jit", [False, True])
def test_linearize_and_jacfwd_run_only_the_tangent_part(rules, jit):
  wrap = jax.jit if jit else (lambda f: f)
  primal = {"fwd, bwd": "fwd", "fwd_bwd": "f", "all three": "fwd"}[rules]
  F = smart_sin(rules)
  lin = wrap(lambda x, t: jax.linearize(F, x)[1](t))
  out, counts = K.run(lin, X, T)
  _close(out, jnp.cos(X) * T)
  # the forward pass of linearize runs once (outside jit: fwd or f, as for
  # reverse mode); the linear map runs the tangent kernel only
  assert counts == ({"jvp_t": 1} if jit else {primal: 1, "jvp_t": 1})
  out, counts = K.run(wrap(jax.jacfwd(F)), X)
  _close(out, jnp.diag(jnp.cos(X)))
  # jacfwd needs no primal output: only f outside jit, one tangent kernel per
  # basis vector (the kernels here are sequential callbacks)
  assert counts == ({"jvp_t": 3} if jit else {"f": 1, "jvp_t": 3})


REVERSE = {
    "grad": lambda F: jax.grad(lambda x: F(x).sum())(X),
    "jit(grad)": lambda F: jax.jit(jax.grad(lambda x: F(x).sum()))(X),
    "grad(checkpoint)": lambda F: jax.grad(
        lambda x: jax.checkpoint(F)(x).sum())(X),
    "jit(grad(checkpoint))": lambda F: jax.jit(jax.grad(
        lambda x: jax.checkpoint(F)(x).sum()))(X),
    "vmap(grad)": lambda F: jax.vmap(jax.grad(lambda x: F(x).sum()))(XS),
    "grad(vmap)": lambda F: jax.grad(lambda x: jax.vmap(F)(x).sum())(XS),
    "vjp": lambda F: jax.vjp(F, X)[1](T),
}


@pytest.mark.parametrize("rules", RULE_SETS)
@pytest.mark.parametrize("program", sorted(REVERSE))
def test_reverse_mode_never_runs_the_forward_rule(rules, program):
  out, counts = K.run(REVERSE[program], smart_sin(rules))
  _, without = K.run(REVERSE[program], smart_sin(rules, jvp=None))
  _close(out, REVERSE[program](jnp.sin))
  assert counts == without
  assert not {"jvp_f", "jvp_t"} & set(counts)


def test_forward_mode_of_an_opaque_bwd_needs_the_rule():
  F = smart_sin("fwd, bwd", jvp=None)
  with pytest.raises(TypeError, match="transpose"):
    jax.jvp(F, (X,), (T,))
  _close(jax.jvp(smart_sin("fwd, bwd"), (X,), (T,)), jax.jvp(jnp.sin, (X,),
                                                            (T,)))


def _xw(symbolic_zeros=False, seen=None):
  """f(x, w) = sin(x) * w in JAX code, its jvp rule noting what it got."""
  def f(x, w):
    return jnp.sin(x) * w

  def fwd(x, w):
    if symbolic_zeros:
      x, w = x.value, w.value
    return f(x, w), (x, w)

  def bwd(res, g):
    x, w = res
    return g * w * jnp.cos(x), jnp.sum(g * jnp.sin(x))

  def jvp(primals, tangents):
    if seen is not None:
      seen.append((primals, tangents))
    (x, w), (tx, tw) = primals, tangents
    y = jnp.sin(x)
    dy = jnp.zeros_like(y)
    if not isinstance(tx, SymbolicZero):
      dy = dy + jnp.cos(x) * tx * w
    if not isinstance(tw, SymbolicZero):
      dy = dy + y * tw
    return y * w, dy

  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros, jvp=jvp)
  return F, f


@pytest.mark.parametrize("symbolic_zeros", [False, True])
def test_zero_tangents_reach_the_rule_as_jax_custom_jvp_gives_them(
    symbolic_zeros):
  seen = []
  F, f = _xw(symbolic_zeros, seen)
  w = jnp.float32(2.0)
  got = jax.jvp(lambda x: F(x, w), (X,), (T,))
  _close(got, jax.jvp(lambda x: f(x, w), (X,), (T,)))
  (x, w_in), (tx, tw) = seen[-1]
  assert not isinstance(x, jax.custom_derivatives.CustomVJPPrimal)
  if symbolic_zeros:
    assert isinstance(tw, SymbolicZero) and tw.aval.shape == ()
  else:
    assert tw.shape == () and float(tw) == 0.0
  # both arguments moving, jacfwd over both
  _close(jax.jacfwd(F, argnums=(0, 1))(X, w),
         jax.jacfwd(f, argnums=(0, 1))(X, w))


def test_nondiff_arguments_come_first_and_integer_inputs_get_float0():
  seen = []

  def f(n, x, k):
    return jnp.sin(x) * n + k

  def fwd(n, x, k):
    return f(n, x, k), (x,)

  def bwd(n, res, g):
    (x,) = res
    return g * n * jnp.cos(x), None

  def jvp(n, primals, tangents):
    seen.append(tangents)
    (x, k), (tx, _) = primals, tangents
    return f(n, x, k), jnp.cos(x) * tx * n

  F = smart_custom_vjp(f, nondiff_argnums=(0,))
  F.defvjp(fwd, bwd, jvp=jvp)
  k = jnp.int32(3)
  out = jax.jvp(lambda x: F(2.0, x, k), (X,), (T,))
  _close(out, jax.jvp(lambda x: f(2.0, x, k), (X,), (T,)))
  assert seen[-1][1].dtype == jax.dtypes.float0


def test_python_residuals_stay_python_values_with_a_forward_rule():
  def f(x):
    return jnp.sin(x)

  def fwd(x):
    return jnp.sin(x), (jnp.cos(x), 8)

  def bwd(res, g):
    c, n = res
    assert isinstance(n, int)
    return (g * c * (min(n, 3) / 3),)

  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd, jvp=lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
  g = jax.grad(lambda x: jnp.sum(jax.vmap(F)(x)))(XS)
  _close(g, jnp.cos(XS))
  _close(jax.linearize(F, X)[1](T), jnp.cos(X) * T)


def test_hessian_with_jax_coded_rules():
  F, f = _xw()
  w = jnp.float32(1.5)
  _close(jax.hessian(lambda x: jnp.sum(F(x, w) ** 2))(X),
         jax.hessian(lambda x: jnp.sum(f(x, w) ** 2))(X))
  _close(jax.jacfwd(jax.jacfwd(lambda x: F(x, w)))(X),
         jax.jacfwd(jax.jacfwd(lambda x: f(x, w)))(X))


def _bad(returns):
  def f(x):
    return {"y": jnp.sin(x)}

  def fwd(x):
    return f(x), (jnp.cos(x),)

  def bwd(res, g):
    return (g["y"] * res[0],)

  def my_jvp(primals, tangents):
    return returns(primals[0], tangents[0])

  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd, jvp=my_jvp)
  return F


@pytest.mark.parametrize("returns, match", [
    (lambda x, t: jnp.sin(x), r"must return a pair"),
    (lambda x, t: (jnp.sin(x), jnp.cos(x) * t),
     r"primal output whose pytree structure differs"),
    (lambda x, t: ({"y": jnp.sin(x)}, jnp.cos(x) * t),
     r"tangent output whose pytree structure differs"),
    (lambda x, t: ({"y": jnp.sin(x)[:2]}, {"y": t}),
     r"at output\['y'\]: expected (f32|float32)\[3\], got (f32|float32)\[2\]"),
    (lambda x, t: ({"y": jnp.sin(x)}, {"y": t.astype(jnp.int32)}),
     r"tangent at output\['y'\] of type (i32|int32)\[3\]"),
])
def test_a_bad_forward_rule_is_named(returns, match):
  F = _bad(returns)
  with pytest.raises(TypeError, match=r"the jvp rule my_jvp of smart_custom_vjp "
                     r"function f .*" + match):
    jax.jvp(F, (X,), (T,))


def test_a_forward_rule_must_be_callable():
  F = smart_custom_vjp(jnp.sin)
  with pytest.raises(TypeError, match="defvjp's jvp must be callable"):
    F.defvjp(fwd_bwd=lambda x, g: (g,), jvp=3)
