"""vmap: batching rules for every smartvjp primitive, compared with
jax.custom_vjp, with per-example kernel counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
from kernels import run
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
def test_vmap_outside_grad_unbatched_weight(ad_mode, remat):
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
def test_vmap_inside_grad_sums_weight_cotangent(ad_mode, remat):
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


def test_checkpoint_of_vmap_and_nonzero_axes(ad_mode):
  s, r = build()

  def loss(F):
    G = jax.checkpoint(jax.vmap(F, in_axes=(1, None), out_axes=1))
    return lambda x, w: jnp.sum(G(x, w) ** 2)

  counts = same(jax.jit(jax.grad(loss(s), (0, 1))),
                jax.jit(jax.grad(loss(r), (0, 1))), X.T, W)
  assert counts == {"f": B, "fwd": B, "bwd": B}


def test_vmap_of_scan_of_checkpointed_layer(ad_mode):
  s, r = build()

  def loss(F):
    def body(c, _):
      return jax.checkpoint(F)(c, W), None
    return lambda x: jnp.sum(jax.lax.scan(body, x, None, length=2)[0] ** 2)

  counts = same(jax.jit(jax.vmap(jax.grad(loss(s)))),
                jax.jit(jax.vmap(jax.grad(loss(r)))), X)
  assert counts == {"f": 2 * B, "fwd": 2 * B, "bwd": 2 * B}


@pytest.mark.parametrize("fused", ["also", "only"])
def test_vmap_fused_rule(ad_mode, fused):
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


def test_outputs_independent_of_batched_inputs_stay_unbatched():
  def fun(x, w):
    return jnp.sin(x) * w, jnp.cos(w)

  def fwd(x, w):
    return fun(x, w), (x, w)

  def bwd(r, g):
    x, w = r
    return g[0] * jnp.cos(x) * w, g[0] * jnp.sin(x) - g[1] * jnp.sin(w)

  s = smart_custom_vjp(fun)
  s.defvjp(fwd, bwd)
  a, b = jax.vmap(s, in_axes=(0, None), out_axes=(0, None))(X, W)
  assert a.shape == X.shape and b.shape == W.shape
  loss = lambda F: (lambda x, w: jnp.sum(
      jax.vmap(F, in_axes=(0, None), out_axes=(0, None))(x, w)[1] ** 2
      + jax.vmap(F, in_axes=(0, None))(x, w)[0]))
  gs = jax.grad(loss(s), (0, 1))(X, W)
  gr = jax.grad(loss(fun), (0, 1))(X, W)
  for a, b in zip(gs, gr):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_forward_mode_under_vmap_of_tangents_or_primals():
  def fun(x, w):
    return jnp.sin(x) * w

  s = smart_custom_vjp(fun)
  s.defvjp(lambda x, w: (fun(x, w), (jnp.cos(x), jnp.sin(x), w)),
           lambda r, g: (g * r[0] * r[2], g * r[1]))
  x = jnp.array([0.3, 0.7, 1.1])
  ws = jnp.stack([x + 1, x + 2])
  for F in (s,):
    got = jax.vmap(lambda w: jax.jvp(F, (x, w), (x, x))[1])(ws)
    want = jax.vmap(lambda w: jax.jvp(fun, (x, w), (x, x))[1])(ws)
    np.testing.assert_allclose(got, want, rtol=1e-6)
  hvp = lambda F: (lambda xx: jax.jvp(jax.grad(
      lambda w: jnp.sum(jax.checkpoint(F)(xx, x + 1) ** 2)), (x + 1,), (x,))[1])
  xs = jnp.stack([x, 2 * x])
  np.testing.assert_allclose(jax.vmap(hvp(s))(xs), jax.vmap(hvp(fun))(xs),
                             rtol=1e-5, atol=1e-6)


def test_fwd_may_touch_batched_inputs_for_an_unbatched_output():
  def fun(x, w):
    return x * w, w * 2

  def fwd(x, w):
    return (x * w, w * 2 + 0 * x), (x, w)   # same value, touches x

  def bwd(r, g):
    return g[0] * r[1], g[0] * r[0] + 2 * g[1]

  s, ref = smart_custom_vjp(fun), jax.custom_vjp(fun)
  for F in (s, ref):
    F.defvjp(fwd, bwd)
  loss = lambda F: (lambda x, w: jnp.sum(
      jax.vmap(F, in_axes=(0, None))(x, w)[1]))
  np.testing.assert_allclose(jax.grad(loss(s), 1)(X, W),
                             jax.grad(loss(ref), 1)(X, W), rtol=1e-6)


def _constant_f_batched_fwd(dec):
  """JAX's test_overbatched_fwd_rule_error: ``f`` an unbatched constant,
  ``fwd`` a mapped value."""
  F = dec(lambda x: np.zeros(x.shape, x.dtype))
  F.defvjp(lambda x: (x * 0., None), lambda _, g: (g,))
  return F


@pytest.mark.parametrize("how", ["grad", "jit_grad", "vjp", "grad_pair"])
def test_fwd_mapped_output_where_f_is_not_follows_fwd_like_custom_vjp(how):
  """Differentiated, the output is mapped as ``fwd``'s is (each example's
  ``bwd`` gets its own cotangent), as with the classic ``jax.custom_vjp``;
  it used to follow ``f`` and send the whole cotangent to one example."""
  def prog(F):
    if how == "vjp":
      return lambda x: jax.vjp(jax.vmap(F), x)[1](jnp.arange(1., 4.))[0]
    if how == "grad_pair":
      G = lambda x, w: (F(x), x * w)
      return jax.grad(lambda x: sum(jnp.sum(o) for o in jax.vmap(
          G, in_axes=(0, None))(x, 2.)))
    g = jax.grad(lambda x: jax.vmap(F)(x).sum())
    return jax.jit(g) if how == "jit_grad" else g
  x = jnp.arange(3.)
  want = prog(_constant_f_batched_fwd(jax.custom_vjp))(x)  # classic path
  got = prog(_constant_f_batched_fwd(smart_custom_vjp))(x)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(want, [3., 0., 0.])


def test_nonlinear_bwd_sees_an_unbatched_cotangent_once_like_custom_vjp():
  def both(x, w):
    return x, w

  def clip_bwd(_, g):
    return jnp.clip(g[0], -1, 1), jnp.clip(g[1], -1, 1)

  s, ref = smart_custom_vjp(both), jax.custom_vjp(both)
  for F in (s, ref):
    F.defvjp(lambda x, w: ((x, w), None), clip_bwd)
  xs = jnp.array([[3.0], [0.5], [-2.0]])
  w = jnp.array([1.0])
  loss = lambda F: (lambda w: jnp.sum(jax.vmap(
      lambda x, w: jnp.sum(F(x, w)[1] * x), in_axes=(0, None))(xs, w)))
  np.testing.assert_allclose(jax.grad(loss(s))(w), jax.grad(loss(ref))(w))


def _psum_call(kind):
  def f(x):
    return jax.lax.psum(x, "foo")
  F = smart_custom_vjp(f) if kind == "smart" else jax.custom_vjp(f)
  F.defvjp(lambda x: (jax.lax.psum(x, "foo"), None), lambda _, g: (3 * g,))
  return F


@pytest.mark.parametrize("how", ["eval_jaxpr", "direct", "grad", "scan",
                                 "grad_scan"])
def test_collective_over_the_vmapped_axis_with_unbatched_input(how):
  """f names the vmapped axis but its input is not mapped: the psum must
  still see the axis (jax.custom_vjp's result)."""
  def run_with(F):
    def g(x):
      if how == "eval_jaxpr":
        jaxpr = jax.make_jaxpr(F)(x)
        from jax._src import core as jax_core  # as JAX's peer test does
        return jax_core.eval_jaxpr(jaxpr.jaxpr, [], x)[0]

      def scanned(x):
        return jax.lax.scan(lambda c, _: (F(c), None), x, None, length=2)[0]
      return {"direct": F, "grad": jax.grad(lambda x: 2 * F(x)),
              "scan": scanned, "grad_scan": jax.grad(scanned)}[how](x)
    return jax.vmap(lambda _, x: g(x), axis_name="foo", in_axes=(0, None),
                    out_axes=None)(jnp.arange(4.0), 2.0)
  want = run_with(_psum_call("custom"))
  np.testing.assert_allclose(run_with(_psum_call("smart")), want)


def _closing_over(kind, x, in_bwd=False):
  """``g(y) = x * y`` whose rules close over ``x``, a value being vmapped
  (fwd always; bwd too when ``in_bwd``)."""
  def f(y):
    return x * y

  def fwd(y):
    return x * y, (x, x * y, y)

  def bwd(res, w_bar):
    return ((x if in_bwd else res[0]) * w_bar * jnp.cos(res[2]),)
  g = smart_custom_vjp(f) if kind == "smart" else jax.custom_vjp(f)
  g.defvjp(fwd, bwd)
  return g


def _grad_closing_over(kind, in_bwd, jit, batched):
  def h(z):
    if batched:
      return jax.vmap(lambda x, z: _closing_over(kind, x, in_bwd)(z))(
          jnp.arange(3.0), z).sum()
    return jax.vmap(lambda x: _closing_over(kind, x, in_bwd)(z))(
        jnp.arange(3.0)).sum()
  g = jax.jit(jax.grad(h)) if jit else jax.grad(h)
  return g(jnp.array([0.5, 1.0, 2.0]) if batched else jnp.float32(3.14))


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_fwd_closing_over_a_vmapped_value(jit, batched):
  """JAX's test_closure_with_vmap2 shape (with an unbatched argument, and
  with a batched one): fwd closes over the vmapped value; gradients as
  jax.custom_vjp's."""
  np.testing.assert_allclose(_grad_closing_over("smart", False, jit, batched),
                             _grad_closing_over("custom", False, jit, batched),
                             rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_bwd_closing_over_a_vmapped_value_raises_as_jax(jit):
  """A bwd that closes over the vmapped value runs after the vmap: an
  UnexpectedTracerError, as with jax.custom_vjp."""
  for kind in ("custom", "smart"):
    with pytest.raises(jax.errors.UnexpectedTracerError):
      _grad_closing_over(kind, True, jit, False)


def test_rules_closing_over_a_vmapped_value_under_remat_raise_as_jax():
  """Under jax.checkpoint jax.custom_vjp raises an UnexpectedTracerError;
  so does smartvjp (the exception type, not a silent value)."""
  def grad_of(kind):
    def h(z):
      def per_example(x):
        return _closing_over(kind, x)(z)
      return jax.vmap(per_example)(jnp.arange(3.0, dtype=jnp.float32)).sum()
    return jax.grad(jax.checkpoint(h))(jnp.float32(3.14))
  with pytest.raises(jax.errors.UnexpectedTracerError):
    grad_of("custom")
  with pytest.raises(jax.errors.UnexpectedTracerError):
    grad_of("smart")


@jax.tree_util.register_pytree_node_class
class _Cloud:
  """A pytree whose ``y=None`` means "y is x" (as ott-jax's ``PointCloud``):
  rebuilt from per-leaf axes, it would give ``y`` the axis of ``x``."""

  def __init__(self, x, y=None):
    self.x, self.y = x, x if y is None else y

  def tree_flatten(self):
    return (self.x, self.y), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children)


def _residual_program(impl, residuals):
  def f(x, y, c):
    return jnp.sin(x) * jnp.sum(y) * c

  def fwd(x, y, c):
    return f(x, y, c), residuals(x, y, c)

  def bwd(res, g):
    cloud, c = res
    dx = jnp.cos(cloud.x) * jnp.sum(cloud.y) * c * g
    return dx, jnp.ones_like(cloud.y) * jnp.sum(jnp.sin(cloud.x) * c * g), 0.0
  F = impl(f)
  F.defvjp(fwd, bwd)
  return F


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("order", ["grad(vmap)", "vmap(grad)"])
def test_residual_pytree_that_rebuilds_none_and_python_float_input(jit, order):
  """ott-jax's Sinkhorn under grad(vmap): a residual pytree whose
  unflattening reads None as another field (axes must not go through it),
  and a float input passed as a Python number kept as a residual (bwd gets
  a float subclass back where fwd saw a tracer: it stays unmapped)."""
  y = jnp.linspace(0.0, 1.0, 5)

  def residuals(x, y, c):
    return _Cloud(x, y), c
  outs = []
  for impl in (jax.custom_vjp, smart_custom_vjp):
    F = _residual_program(impl, residuals)
    if order == "grad(vmap)":
      g = jax.grad(lambda xs: jnp.sum(jax.vmap(lambda x: F(x, y, 2.0))(xs)))
    else:
      g = jax.vmap(jax.grad(lambda x: jnp.sum(F(x, y, 2.0))))
    outs.append((jax.jit(g) if jit else g)(X))
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6)
