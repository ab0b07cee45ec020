"""Forward mode (jvp, jacfwd, linearize): an extension over jax.custom_vjp.

The JVP at x is the transpose of g -> bwd(res(x), g); checked against JAX's
own forward mode of the plain function."""

import re

import jax
import smartvjp
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
from smartvjp import smart_custom_vjp

X = jnp.array([0.3, -1.2, 2.0], jnp.float32)


def gelu_matmul(fused=None):
  def f(x, w):
    return jax.nn.gelu(x @ w)

  def fwd(x, w):
    y = x @ w
    return jax.nn.gelu(y), (x, w, y)

  def bwd(res, g):
    x, w, y = res
    _, vjp = jax.vjp(jax.nn.gelu, y)
    (dy,) = vjp(g)
    return dy @ w.T, x.T @ dy

  def fwd_bwd(x, w, g):
    return bwd((x, w, x @ w), g)

  s = smart_custom_vjp(f)
  if fused == "only":
    s.defvjp(fwd_bwd=fwd_bwd)
  else:
    s.defvjp(fwd, bwd)
  return s, f


@pytest.mark.parametrize("fused", [None, "only"])
def test_jvp_jacfwd_linearize(fused):
  s, plain = gelu_matmul(fused)
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k1, (4, 3))
  w = jax.random.normal(k2, (3, 2))
  tx = jax.random.normal(k3, (4, 3))
  tw = jnp.ones((3, 2))
  ys, ts = jax.jvp(s, (x, w), (tx, tw))
  yr, tr = jax.jvp(plain, (x, w), (tx, tw))
  np.testing.assert_allclose(ys, yr, rtol=1e-5)
  np.testing.assert_allclose(ts, tr, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jax.jit(jax.jacfwd(s, argnums=1))(x, w),
                             jax.jacfwd(plain, argnums=1)(x, w), rtol=1e-5,
                             atol=1e-6)
  _, lin = jax.linearize(s, x, w)
  np.testing.assert_allclose(lin(tx, tw), tr, rtol=1e-5, atol=1e-6)
  jf = jax.jacfwd(jax.checkpoint(lambda x: s(x, w)))(x)
  np.testing.assert_allclose(jf, jax.jacfwd(lambda x: plain(x, w))(x),
                             rtol=1e-5, atol=1e-6)


def test_forward_mode_through_while_loop():
  s, plain = gelu_matmul()
  w = jnp.eye(3) * 0.5

  def loop(F):
    return lambda x: jax.lax.while_loop(lambda c: c[1] < 3,
                                        lambda c: (F(c[0], w), c[1] + 1),
                                        (x, 0))[0]

  x = jnp.ones((2, 3))
  np.testing.assert_allclose(loop(s)(x), loop(plain)(x), rtol=1e-6)
  ts = jax.jvp(loop(s), (x,), (jnp.ones_like(x),))[1]
  tr = jax.jvp(loop(plain), (x,), (jnp.ones_like(x),))[1]
  np.testing.assert_allclose(ts, tr, rtol=1e-5, atol=1e-6)


def test_opaque_bwd_forward_mode_error():
  f, fwd, bwd, _ = K.sin_rules()
  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd)
  with pytest.raises(TypeError, match="forward-mode.*needs a bwd rule \\(bwd\\) "
                     "that JAX can transpose") as e:
    jax.jvp(F, (X,), (X,))
  # the message ends with the documented fix, not with the cause's advice
  tail = str(e.value).split("JAX said:")[1].split(")", 1)[1]
  assert re.search(r"give a forward rule instead: f\.defvjp\(\.\.\., "
                   r"jvp=rule\)", tail), e.value
  assert "jax.custom_vjp" not in tail, e.value
  # the fix it names works
  G = smart_custom_vjp(f)
  G.defvjp(fwd, bwd, jvp=lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
  np.testing.assert_allclose(jax.jvp(G, (X,), (X,))[1], jnp.cos(X) * X,
                             rtol=1e-6)


def test_untransposable_rule_error_is_also_jax_custom_vjp_s_type():
  """Where jax.custom_vjp differentiates an opaque backward rule (jvp of
  grad), it raises the callback's ValueError; so does smartvjp given only
  fwd_bwd (as jax.custom_vjp with a fwd saving the inputs), with a note
  naming fwd_bwd (found by tools/fuzz_dropin.py, seeds 200710 and 300520).
  Plain forward mode, which jax.custom_vjp refuses, is smartvjp's TypeError
  asking for a transposable fwd_bwd."""
  import numpy as np

  def opaque_vjp(x, g):
    return jax.pure_callback(
        lambda x, g: np.asarray(np.cos(x) * g, np.float32),
        jax.ShapeDtypeStruct(g.shape, g.dtype), x, g)

  x = jnp.array([0.3, -1.2, 2.0], jnp.float32)
  ref = jax.custom_vjp(jnp.sin)
  ref.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (opaque_vjp(x, g),))
  F = smart_custom_vjp(jnp.sin)
  F.defvjp(fwd_bwd=lambda x, g: (opaque_vjp(x, g),))
  hvp = lambda G: jax.jvp(jax.grad(lambda y: jnp.sum(jax.jit(G)(y))), (x,), (x,))
  with pytest.raises(Exception) as theirs:
    hvp(ref)
  with pytest.raises(Exception) as ours:
    hvp(F)
  assert type(theirs.value) is not TypeError
  assert type(ours.value) is type(theirs.value)
  assert any("fwd_bwd rule" in n for n in ours.value.__notes__)
  with pytest.raises(TypeError, match="needs a fwd_bwd rule"):
    jax.jvp(F, (x,), (x,))


def _numpy_rules(make, raising):
  """A bwd (or fwd_bwd) that runs NumPy on the cotangent, as agjax's eager
  wrapper and cvxpylayers do: it works in reverse mode eagerly and cannot
  be traced for a transposition."""
  def numpy_vjp(x, g):
    if raising and isinstance(g, jax.core.Tracer):
      raise ValueError("the library refuses a traced cotangent")
    return jnp.asarray(np.cos(np.asarray(x)) * np.asarray(g))

  F = make(jnp.sin)
  F.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (numpy_vjp(x, g),))
  return F


@pytest.mark.parametrize("raising", [False, True], ids=["numpy", "raises"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_untraceable_bwd_in_forward_mode_is_our_type_error(jit, raising):
  """Issue 56: the bwd's own error (TracerArrayConversionError, or the
  library's) never escapes a transposition smartvjp chose to try: forward
  mode raises the TypeError type jax.custom_vjp raises, naming jvp=."""
  ref, F = (_numpy_rules(m, raising) for m in (jax.custom_vjp, smart_custom_vjp))
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(F(x)))(X),
                             jax.grad(lambda x: jnp.sum(ref(x)))(X), rtol=1e-6)
  run = lambda G: (jax.jit(lambda x: jax.jvp(G, (x,), (x,)))(X) if jit
                   else jax.jvp(G, (X,), (X,)))
  with pytest.raises(Exception) as theirs:
    run(ref)
  with pytest.raises(TypeError, match=r"jvp=rule") as ours:
    run(F)
  assert type(theirs.value) is TypeError
  # our error, raised from the rule's (as its __cause__); where the rule
  # raised its own type, ours is also of that type, as for an opaque bwd
  assert "forward-mode differentiation" in str(ours.value)
  assert not isinstance(ours.value, jax.errors.TracerArrayConversionError)
  assert ("ValueError: the library refuses" if raising
          else "TracerArrayConversionError") in str(ours.value)
  assert isinstance(ours.value, ValueError) == raising


def _numpy_fn(raising, calls):
  def numpy_sin(x):
    calls.append(type(x))
    if raising and isinstance(x, jax.core.Tracer):
      raise ValueError("the library refuses a traced array")
    return jnp.asarray(np.sin(np.asarray(x)))
  return numpy_sin


def _jax_sin(x):
  return jnp.sin(x)


@pytest.mark.parametrize("raising", [False, True], ids=["numpy", "raises"])
@pytest.mark.parametrize("which", ["f", "fwd", "both"])
@pytest.mark.parametrize("how", ["jvp", "jacfwd"])
def test_untraceable_f_or_fwd_in_forward_mode_is_our_type_error(
    ad_mode, how, which, raising):
  """Issue 65 item 1: eager forward mode of a call whose f (or fwd) runs
  NumPy (an eager black-box wrapper) raises the TypeError type
  jax.custom_vjp raises, naming the rule and jvp=, not the
  TracerArrayConversionError (or the library's error) from inside it;
  reverse mode still works eagerly, as with jax.custom_vjp (which under
  jax_custom_vjp3 traces f first: its error is then f's tracing error, a
  TypeError too, and its eager grad fails where smartvjp's works)."""
  traces_f = ad_mode == "remat3" and which != "fwd"
  calls = []
  npf = _numpy_fn(raising, calls)
  f = npf if which in ("f", "both") else _jax_sin
  fwd_f = npf if which in ("fwd", "both") else _jax_sin
  bwd = lambda x, g: (jnp.cos(x) * g,)
  ref, F = (m(f) for m in (jax.custom_vjp, smart_custom_vjp))
  for G in (ref, F):
    G.defvjp(lambda x: (fwd_f(x), x), bwd)
  want = jnp.cos(X) if traces_f else jax.grad(lambda x: jnp.sum(ref(x)))(X)
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(F(x)))(X), want,
                             rtol=1e-6)
  run = ((lambda G: jax.jvp(G, (X,), (X,))) if how == "jvp"
         else (lambda G: jax.jacfwd(G)(X)))
  with pytest.raises(Exception) as theirs:
    run(ref)
  # JAX's own error, where it traced f first: ours is also caught by it
  assert type(theirs.value) is TypeError or traces_f and (
      isinstance(theirs.value, (TypeError, ValueError) if raising
                 else jax.errors.TracerArrayConversionError))
  del calls[:]
  with pytest.raises(TypeError, match=r"jvp=rule") as ours:
    run(F)
  message = str(ours.value)
  assert "forward-mode differentiation" in message
  name = "f (numpy_sin)" if which != "fwd" else "fwd (<lambda>)"
  assert f"traces its {name}" in message
  assert ("ValueError: the library refuses" if raising
          else "TracerArrayConversionError") in message
  assert not isinstance(ours.value, jax.errors.TracerArrayConversionError)
  assert isinstance(ours.value, ValueError) == raising
  # the rule ran on tracers only: nothing ran on the values
  assert calls and all(issubclass(t, jax.core.Tracer) for t in calls)


def test_untraceable_f_with_a_forward_rule_says_f_must_trace():
  """A forward rule given: the message does not ask for one."""
  F = smart_custom_vjp(_numpy_fn(False, []))
  F.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g,),
           jvp=lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
  with pytest.raises(TypeError, match="make f traceable") as ours:
    jax.jvp(F, (X,), (X,))
  assert "jvp=rule" not in str(ours.value)


@pytest.mark.parametrize("which", ["f", "fwd"])
def test_untraceable_rule_under_jit_is_jax_custom_vjp_s_error(ad_mode, which):
  """Under jit, jax.custom_vjp's forward mode refuses before tracing f (its
  TypeError; ours names jvp=), but traces fwd (the tracing error, as is)."""
  npf = _numpy_fn(False, [])
  f, fwd_f = (npf, _jax_sin) if which == "f" else (_jax_sin, npf)
  errors = []
  for make in (jax.custom_vjp, smart_custom_vjp):
    G = make(f)
    G.defvjp(lambda x: (fwd_f(x), x), lambda x, g: (jnp.cos(x) * g,))
    with pytest.raises(TypeError) as e:
      jax.jit(lambda x, G=G: jax.jvp(G, (x,), (x,)))(X)
    errors.append(e.value)
  theirs, ours = errors
  # ours: smartvjp's TypeError subclass, caught as jax.custom_vjp's is
  assert (type(ours) is smartvjp.NotTransposableError) == (which == "f")
  if which == "f" and ad_mode == "default":
    assert type(theirs) is TypeError
    assert "jvp=rule" in str(ours)
  elif which == "fwd":
    assert type(theirs) is type(ours) is jax.errors.TracerArrayConversionError


@pytest.mark.parametrize("raising", [False, True], ids=["numpy", "raises"])
def test_forward_mode_error_is_the_exported_class(raising):
  """Issue 70 item 7: one exported class, a TypeError, caught and printed
  by its public name; the rule's own error type (a ValueError) too."""
  import smartvjp
  F = _numpy_rules(smart_custom_vjp, raising)
  with pytest.raises(smartvjp.NotTransposableError) as ours:
    jax.jvp(F, (X,), (X,))
  assert isinstance(ours.value, TypeError)
  assert isinstance(ours.value, ValueError) == raising
  assert type(ours.value).__module__ == "smartvjp"
  assert type(ours.value).__name__ == "NotTransposableError"
  assert (type(ours.value) is smartvjp.NotTransposableError) != raising
  assert "smartvjp.NotTransposableError" in "".join(
      __import__("traceback").format_exception_only(ours.value))
  assert ours.value.__cause__ is not None
