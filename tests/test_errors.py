"""Bad input gets a clear error naming the rule, the pytree path and the
expected vs actual type, never a wrong gradient or an internal assertion."""

import functools

import jax
import jax.numpy as jnp
import pytest

from smartvjp import smart_custom_vjp
from smartvjp._checks import function_location

X = jnp.ones((2, 3), jnp.float32)


def make(fwd=None, bwd=None, jax_impl=False, **kw):
  def my_f(x, y):
    return {"out": x * y, "aux": (x,)}

  def good_fwd(x, y):
    return my_f(x, y), (x, y)

  def good_bwd(res, g):
    x, y = res
    return g["out"] * y + g["aux"][0], g["out"] * x

  F = (jax.custom_vjp if jax_impl else smart_custom_vjp)(my_f, **kw)
  F.defvjp(fwd or good_fwd, bwd or good_bwd)
  return F


def grad_of(F, remat=False):
  G = jax.checkpoint(F) if remat else F
  return jax.grad(lambda x, y: jnp.sum(G(x, y)["out"]), argnums=(0, 1))


@pytest.mark.parametrize("remat", [False, True])
def test_fwd_not_a_pair(remat):
  def my_fwd(x, y):
    return x * y
  with pytest.raises(TypeError, match=r"the fwd rule my_fwd of smart_custom_vjp "
                     r"function my_f must return a pair"):
    grad_of(make(fwd=my_fwd), remat)(X, X)


# Where f has been traced (a staged call differentiated: jit(F) under grad,
# a checkpoint), fwd's primal output is checked against it when fwd is
# traced, as JAX does; jax.grad applied directly (eager or inside jit) traces
# neither f nor the check, as with jax.custom_vjp, and names fwd only if an
# error surfaces (test_*_names_fwd_when_its_primal_output_differs below).
F_TRACED = {"grad(jit(F))": lambda F: jax.jit(grad_of(jax.jit(F))),
            "jit(grad(checkpoint(F)))": lambda F: jax.jit(grad_of(F, True))}


@pytest.mark.parametrize("program", sorted(F_TRACED))
def test_fwd_primal_structure_differs(program):
  def my_fwd(x, y):
    return {"out": x * y}, (x, y)
  with pytest.raises(TypeError, match=r"my_fwd.*pytree structure differs from "
                     r"my_f's output"):
    F_TRACED[program](make(fwd=my_fwd))(X, X)


@pytest.mark.parametrize("program", sorted(F_TRACED))
@pytest.mark.parametrize("bad,expected,got", [
    (lambda x: x[:1], "float32\\[2,3\\]", "float32\\[1,3\\]"),
    (lambda x: x.astype(jnp.float16), "float32\\[2,3\\]", "float16\\[2,3\\]")])
def test_fwd_primal_shape_or_dtype_differs(bad, expected, got, program):
  def my_fwd(x, y):
    return {"out": bad(x * y), "aux": (x,)}, (x, y)
  with pytest.raises(TypeError, match=rf"my_fwd.*at output\['out'\]: expected "
                     rf"{expected}, got {got}"):
    F_TRACED[program](make(fwd=my_fwd))(X, X)


def test_residuals_not_jax_types():
  def my_fwd(x, y):
    return {"out": x * y, "aux": (x,)}, (x, "not an array")
  with pytest.raises(TypeError, match=r"my_fwd.*type str at residuals\[1\].*not a "
                     r"valid JAX type.*make it an argument listed in "
                     r"nondiff_argnums.*or close over it in both fwd and bwd"):
    grad_of(make(fwd=my_fwd))(X, X)


def test_bwd_wrong_length_or_cotangent_for_nondiff_arg():
  def my_bwd(res, g):
    return (g["out"],)
  with pytest.raises(TypeError, match=r"the bwd rule my_bwd of smart_custom_vjp "
                     r"function my_f must return a tuple with one cotangent.*"
                     r"length 2"):
    grad_of(make(bwd=my_bwd))(X, X)

  # a cotangent for the nondiff argument is one entry too many
  @functools.partial(smart_custom_vjp, nondiff_argnums=(1,))
  def scale(x, k):
    return x * k

  def scale_bwd(k, res, g):
    return g * k, 0.0

  scale.defvjp(lambda x, k: (x * k, None), scale_bwd)
  with pytest.raises(TypeError, match=r"scale_bwd.*length 1"):
    jax.grad(lambda x: jnp.sum(scale(x, 2.0)))(X)


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("bad", ["short tuple", "short list", "bare array"])
def test_bwd_wrong_length_raises_jaxs_type_on_each_path(ad_mode, remat, bad):
  """A tuple or list of the wrong length: ``TypeError`` on JAX's default
  path, ``ValueError`` under ``jax_custom_vjp3``; a bare array:
  ``TypeError`` on both (the types ``jax.custom_vjp`` raises there)."""
  def my_bwd(res, g):
    return {"short tuple": (g["out"],), "short list": [g["out"]],
            "bare array": g["out"]}[bad]
  raised = []
  for jax_impl in (True, False):
    with pytest.raises(Exception) as info:
      grad_of(make(bwd=my_bwd, jax_impl=jax_impl), remat)(X, X)
    raised.append(type(info.value))
  assert raised[0] in (TypeError, ValueError), raised
  assert raised[1] is raised[0], raised


def test_bwd_wrong_structure():
  def my_bwd(res, g):
    x, y = res
    return g["out"] * y, {"oops": g["out"]}
  with pytest.raises(TypeError, match=r"my_bwd.*pytree structure"):
    grad_of(make(bwd=my_bwd))(X, X)


@pytest.mark.parametrize("remat", [False, True])
def test_bwd_wrong_shape_or_dtype(remat):
  def my_bwd(res, g):
    x, y = res
    return g["out"] * y, (g["out"] * x)[0]
  with pytest.raises(ValueError, match=r"my_bwd of smart_custom_vjp function "
                     r"my_f returned a cotangent of type float32\[3\] at "
                     r"output\[1\].*has type float32\[2,3\]"):
    grad_of(make(bwd=my_bwd), remat)(X, X)

  def my_bwd_int(res, g):
    x, y = res
    return g["out"] * y, (g["out"] * x)[:1].astype(jnp.int32)
  with pytest.raises(ValueError, match=r"int32\[1,3\] at output\[1\]"):
    grad_of(make(bwd=my_bwd_int))(X, X)


@pytest.mark.parametrize("remat", [False, True])
def test_error_says_where_a_lambda_rule_is_defined(remat):
  """A ``lambda`` rule's name does not find it: the message ends with the
  file and line where the rule is defined (jax 0.12 says where, too)."""
  F = smart_custom_vjp(lambda x: jnp.sin(x))
  bwd = lambda r, g: (jnp.ones(3),)  # noqa: E731
  F.defvjp(lambda x: (jnp.sin(x), x), bwd)
  with pytest.raises(ValueError, match=r"bwd rule <lambda> .*\(bwd is defined "
                     rf"at {__file__}:{bwd.__code__.co_firstlineno}\)"):
    grad_of_sum = jax.grad(lambda x: jnp.sum((jax.checkpoint(F) if remat
                                              else F)(x)))
    grad_of_sum(jnp.ones(2))


def test_rule_location_through_partial_and_callable_objects():
  def rule(a, b):
    return a

  class Rule:
    def __call__(self, x):
      return x
  here = rule.__code__.co_firstlineno
  assert function_location(functools.partial(rule, 1)) == f"{__file__}:{here}"
  assert function_location(Rule()).endswith(
      f":{Rule.__call__.__code__.co_firstlineno}")
  assert function_location(len) is None


@pytest.mark.parametrize("ct_dtype", [jnp.float16, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("remat", [False, True])
def test_other_float_precision_passes_through_like_jax(ct_dtype, remat):
  """jax.custom_vjp passes a same-shape cotangent of another dtype on as bwd
  returned it (no cast) when the input's cotangent is a float; so does
  smartvjp, on the same paths, with the same values."""
  def my_bwd16(res, g):
    x, y = res
    return g["out"] * y, (g["out"] * x).astype(ct_dtype)
  gx, gy = grad_of(make(bwd=my_bwd16), remat)(X, X)
  jx, jy = grad_of(make(bwd=my_bwd16, jax_impl=True), remat)(X, X)
  assert gy.dtype == jy.dtype == ct_dtype
  assert gx.dtype == jx.dtype == jnp.float32
  assert jnp.array_equal(gy, jy) and jnp.array_equal(gx, jx)


@pytest.mark.parametrize("remat", [False, True])
def test_bwd_checks_can_be_disabled_like_jax(remat):
  """jax_disable_bwd_checks: a wrong-shape cotangent is passed on unchecked,
  as jax.custom_vjp does (it becomes the gradient as returned)."""
  from jax._src import config

  def my_bwd(res, g):
    x, y = res
    return g["out"] * y, (g["out"] * x)[0]
  with config.disable_bwd_checks(True):
    gx, gy = grad_of(make(bwd=my_bwd), remat)(X, X)
    jx, jy = grad_of(make(bwd=my_bwd, jax_impl=True), remat)(X, X)
  assert gy.shape == jy.shape == (3,)
  assert jnp.array_equal(gy, jy) and jnp.array_equal(gx, jx)
  with pytest.raises(ValueError, match=r"float32\[3\] at output\[1\]"):
    grad_of(make(bwd=my_bwd), remat)(X, X)


def test_fwd_bwd_wrong_output():
  @smart_custom_vjp
  def my_f(x):
    return x * 2.0

  def my_fwd_bwd(x, g):
    return g * 2.0  # not a tuple
  my_f.defvjp(fwd_bwd=my_fwd_bwd)
  with pytest.raises(TypeError, match=r"the fwd_bwd rule my_fwd_bwd of "
                     r"smart_custom_vjp function my_f must return a tuple"):
    jax.grad(lambda x: jnp.sum(my_f(x)))(X)


def test_non_array_argument():
  def my_f(x, mode):
    return x
  F = smart_custom_vjp(my_f)
  F.defvjp(lambda x, m: (x, None), lambda r, g: (g, None))
  with pytest.raises(TypeError, match=r"my_f was called with a value of type "
                     r"str at \(differentiable\) arguments\[1\].*nondiff_argnums"):
    F(X, "fast")


def test_keyword_only_arguments_are_refused_clearly():
  def my_f(x, *, scale):
    return x * scale
  F = smart_custom_vjp(my_f)
  F.defvjp(lambda x, scale: (x, None), lambda r, g: (g,))
  with pytest.raises(TypeError, match=r"my_f could not be resolved.*scale"):
    F(X, scale=2.0)


def test_unknown_nondiff_argname():
  """Accepted and ignored, as jax.custom_vjp does (0.10.2 and 0.12.0.1)."""
  def my_f(x, k=2.0):
    return x * k
  F = smart_custom_vjp(my_f, nondiff_argnames=("q", "k"))
  G = jax.custom_vjp(my_f, nondiff_argnames=("q", "k"))
  assert F.nondiff_argnums == G.nondiff_argnums == (1,)
  F.defvjp(lambda x, k: (my_f(x, k), None), lambda k, r, g: (g * k,))
  G.defvjp(lambda x, k: (my_f(x, k), None), lambda k, r, g: (g * k,))
  assert jax.grad(F)(1.5, 3.0) == jax.grad(G)(1.5, 3.0) == 3.0
  only_unknown = smart_custom_vjp(my_f, nondiff_argnames=("q",))
  assert only_unknown.nondiff_argnums == ()


def test_forward_mode_error_of_fused_only_function_names_fwd_bwd():
  """A function defined with fwd_bwd alone: an error about its tangent map
  names the fwd_bwd rule, not a missing bwd (NoneType)."""
  import numpy as np

  @smart_custom_vjp
  def my_f(x):
    return jnp.sin(x)

  def my_fused(x, g):
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return (jax.pure_callback(lambda x, g: np.cos(x) * g, out, x, g),)
  my_f.defvjp(fwd_bwd=my_fused)
  x = jnp.ones(3)
  with pytest.raises(TypeError) as info:
    jax.jvp(lambda x: jax.jvp(my_f, (x,), (x,))[1], (x,), (x,))
  assert "fwd_bwd rule (my_fused)" in str(info.value)
  assert "NoneType" not in str(info.value)


def test_errors_never_come_from_bare_asserts():
  """smartvjp's package has no bare ``assert`` (an empty AssertionError as
  the cause of a user's error, and gone under ``python -O``)."""
  import ast
  import pathlib
  import smartvjp
  for path in pathlib.Path(smartvjp.__file__).parent.glob("*.py"):
    tree = ast.parse(path.read_text())
    found = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    assert not found, f"{path.name}: assert at lines {found}"


# -- eager differentiation: fwd named when its primal output is at fault -------

def _eager_case(kind):
  """``(F, loss, x)``: ``fwd``'s primal output is ``f``'s with a wrong shape
  (``kind``: the cotangent reaches a ``bwd`` that multiplies by a residual,
  or one that returns it as it is)."""
  calls = {"f": 0}

  def my_f(x):
    calls["f"] += 1
    return jnp.sin(x)

  def my_fwd(x):
    return jnp.sin(x[:2]), jnp.cos(x)

  bwds = {"multiplies": lambda c, g: (c * g,), "returns_g": lambda c, g: (g,)}
  return my_f, my_fwd, bwds[kind], calls


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind,exc", [("multiplies", TypeError),
                                      ("returns_g", ValueError)])
def test_grad_names_fwd_when_its_primal_output_differs(kind, exc, jit):
  my_f, my_fwd, my_bwd, calls = _eager_case(kind)
  ref = jax.custom_vjp(my_f)
  ref.defvjp(my_fwd, my_bwd)
  F = smart_custom_vjp(my_f)
  F.defvjp(my_fwd, my_bwd)
  x = jnp.ones(3)
  wrap = jax.jit if jit else (lambda g: g)
  with pytest.raises(exc):   # jax.custom_vjp: the same type, naming no rule
    wrap(jax.grad(lambda x: jnp.sum(ref(x))))(x)
  with pytest.raises(exc, match=r"the fwd rule my_fwd of smart_custom_vjp "
                     r"function my_f returned a primal output that differs "
                     r"from my_f's at its output: my_f gives float32\[3\], "
                     r"fwd gives float32\[2\]") as info:
    wrap(jax.grad(lambda x: jnp.sum(F(x))))(x)
  assert info.value.__cause__ is not None   # the original error, chained


def test_eager_grad_names_fwd_for_a_structure_difference():
  def my_f(x):
    return {"a": jnp.sin(x)}

  def my_fwd(x):
    return (jnp.sin(x),), jnp.cos(x)

  F = smart_custom_vjp(my_f)
  F.defvjp(my_fwd, lambda c, g: (c * g["a"],))
  with pytest.raises(TypeError, match=r"fwd rule my_fwd .* pytree structure "
                     r"differs from my_f's output"):
    jax.grad(lambda x: jnp.sum(F(x)[0]))(jnp.ones(3))


def test_eager_grad_happy_path_never_traces_f():
  my_f, _, _, calls = _eager_case("multiplies")
  F = smart_custom_vjp(my_f)
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  jax.grad(lambda x: jnp.sum(F(x)))(jnp.ones(3))
  assert calls["f"] == 0


def test_eager_bwd_error_is_untouched_when_fwd_agrees_with_f():
  F = smart_custom_vjp(lambda x: jnp.sin(x))

  def broken_bwd(c, g):
    raise ZeroDivisionError("bwd's own bug")
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), broken_bwd)
  with pytest.raises(ZeroDivisionError, match="bwd's own bug") as info:
    jax.grad(lambda x: jnp.sum(F(x)))(jnp.ones(3))
  assert not any("smartvjp" in n for n in getattr(info.value, "__notes__", ()))
