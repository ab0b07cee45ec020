"""What ``bwd`` may return, and the gradient dtypes that come out: the same as
``jax.custom_vjp`` with the same rules, on every path.

The table test runs each bwd output through both ``jax.custom_vjp`` and
``smart_custom_vjp`` and asserts the same outcome (the same exception type, or
the same cotangents with the same dtypes), so that a change of what JAX
accepts shows up here.
"""

import functools
import os
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import tree_util
from jax.custom_derivatives import SymbolicZero

import smartvjp
from smartvjp import smart_custom_vjp

IMPLS = {"jax": jax.custom_vjp, "smart": smart_custom_vjp}

# the installed package's folder: a frame or path inside it is smartvjp's own
# (the repository's folder may itself be named smartvjp, as a clone is)
PACKAGE_DIR = os.path.dirname(os.path.abspath(smartvjp.__file__)) + os.sep


@tree_util.register_pytree_node_class
class Box:
  """A custom pytree node with one leaf."""

  def __init__(self, value):
    self.value = value

  def tree_flatten(self):
    return (self.value,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(*children)


class NoNones(list):
  """A custom pytree node whose unflatten refuses None children."""


def _unflatten_no_nones(aux, children):
  del aux
  if any(c is None for c in children):
    raise ValueError("NoNones children must not be None")
  return NoNones(children)


tree_util.register_pytree_node(NoNones, lambda x: (list(x), None),
                               _unflatten_no_nones)


def _outcome(thunk):
  """``("raised", type)`` or ``("ok", leaves)`` for comparing two runs."""
  try:
    out = thunk()
  except Exception as e:  # noqa: BLE001 - the type is what is compared
    return ("raised", type(e))
  return ("ok", tree_util.tree_leaves(out))


def _assert_same(expected, got):
  assert expected[0] == got[0], (expected, got)
  if expected[0] == "raised":
    assert expected[1] is got[1], (expected, got)
    return
  assert len(expected[1]) == len(got[1])
  for e, g in zip(expected[1], got[1]):
    e, g = np.asarray(e), np.asarray(g)
    assert e.dtype == g.dtype, (e.dtype, g.dtype)
    assert e.shape == g.shape, (e.shape, g.shape)
    if e.dtype != jax.dtypes.float0:
      np.testing.assert_array_equal(e, g)


# -- the table of bwd outputs --------------------------------------------------

A = jnp.arange(2.0, dtype=jnp.float32) + 1.0
T = (jnp.arange(3.0, dtype=jnp.float32), jnp.ones(3, jnp.float32) * 2.0)
N = jnp.arange(2, dtype=jnp.int32)
B = Box(jnp.float32(3.0))
F32 = jax.core.ShapedArray((), jnp.float32)


def _ok(g):
  return g * A, (g * T[0], g * T[1]), None, Box(g * 5.0)


BWD_OUTPUTS = {
    "ok": _ok,
    "list_for_tuple": lambda g: list(_ok(g)),
    "all_none": lambda g: (None, None, None, None),
    "none_in_tuple_arg": lambda g: (g * A, (None, g * T[1]), None, None),
    "one_array_for_tuple_arg": lambda g: (g * A, g * T[0], None, Box(g)),
    "bare_value_for_box": lambda g: (g * A, None, None, g * 7.0),
    "int_input_garbage": lambda g: (g * A, None, jnp.ones(5), None),
    "int_input_string": lambda g: (g * A, None, "not an array", None),
    "int_input_float": lambda g: (g * A, None, jnp.ones(2), None),
    "wrong_length": lambda g: (g * A, None),
    "too_long": lambda g: (g * A, None, None, None, None),
    "not_a_tuple": lambda g: g * A,
    "dict_for_tuple_arg": lambda g: (None, {"a": g * T[0]}, None, None),
    "list_for_tuple_arg": lambda g: (None, [g * T[0], g * T[1]], None, None),
    "tuple_for_array_arg": lambda g: ((g * A, g * A), None, None, None),
    "wrong_shape": lambda g: (g * jnp.ones(3), None, None, None),
    "wrong_shape_in_tuple": lambda g: (None, (g * T[0], g * A), None, None),
    "wrong_rank": lambda g: (g * jnp.ones((1, 2)), None, None, None),
    "bf16": lambda g: ((g * A).astype(jnp.bfloat16), None, None, None),
    "f16_in_tuple": lambda g: (None, (g * T[0], (g * T[1]).astype(jnp.float16)),
                               None, None),
    "int32_for_float": lambda g: ((g * A).astype(jnp.int32), None, None, None),
    "bool_for_float": lambda g: (A > 1, None, None, None),
    "complex_for_float": lambda g: ((g * A).astype(jnp.complex64), None, None,
                                    None),
    "bf16_and_accumulated": lambda g: ((g * A).astype(jnp.bfloat16), None, None,
                                       None),
    "numpy_array": lambda g: (np.ones(2, np.float32), None, None, None),
    "python_float_for_box": lambda g: (None, None, None, Box(2.0)),
    "not_an_array": lambda g: ("oops", None, None, None),
    "symbolic_zero": lambda g: (SymbolicZero(jax.core.ShapedArray(
        (2,), jnp.float32)), None, None, None),
    "symbolic_zero_wrong_shape": lambda g: (SymbolicZero(jax.core.ShapedArray(
        (3,), jnp.float32)), None, None, None),
    "symbolic_zero_wrong_dtype": lambda g: (SymbolicZero(jax.core.ShapedArray(
        (2,), jnp.float16)), None, None, None),
    "symbolic_zero_bare_for_box": lambda g: (None, None, None, SymbolicZero(F32)),
    "symbolic_zero_in_box": lambda g: (None, None, None, Box(SymbolicZero(F32))),
    "symbolic_zero_for_tuple_arg": lambda g: (
        None, SymbolicZero(jax.core.ShapedArray((3,), jnp.float32)), None, None),
}


def _make(impl, bwd_out):
  @impl
  def f(a, t, n, b):
    return jnp.sum(a) + jnp.sum(t[0] * t[1]) + b.value + n[0]

  def f_fwd(a, t, n, b):
    return f(a, t, n, b), None

  def f_bwd(_, g):
    return bwd_out(g)

  f.defvjp(f_fwd, f_bwd)
  return f


def _loss_twice(f):
  """Uses ``a`` twice, so that its cotangent is accumulated by JAX."""
  return lambda a, t, n, b: f(a, t, n, b) + jnp.sum(a)


PATHS = {
    "eager": lambda f: lambda *args: jax.vjp(f, *args)[1](jnp.float32(1.0)),
    "jit": lambda f: jax.jit(lambda *args: jax.vjp(f, *args)[1](
        jnp.float32(1.0))),
    "remat": lambda f: lambda *args: jax.vjp(jax.checkpoint(f), *args)[1](
        jnp.float32(1.0)),
    "remat_saving": lambda f: jax.jit(lambda *args: jax.vjp(jax.checkpoint(
        f, policy=jax.checkpoint_policies.everything_saveable), *args)[1](
            jnp.float32(1.0))),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(BWD_OUTPUTS))
def test_bwd_output_table_same_outcome_as_jax(case, path):
  bwd_out = BWD_OUTPUTS[case]
  outcomes = {}
  for name, impl in IMPLS.items():
    f = _make(impl, bwd_out)
    if case == "bf16_and_accumulated":
      f = _loss_twice(f)
    outcomes[name] = _outcome(lambda: PATHS[path](f)(A, T, N, B))
  _assert_same(outcomes["jax"], outcomes["smart"])


@pytest.mark.parametrize("case", ["wrong_shape", "wrong_shape_in_tuple",
                                  "wrong_rank", "bool_for_float"])
def test_disable_bwd_checks_passes_cotangents_on_like_jax(case):
  """With ``jax_disable_bwd_checks`` a mismatched cotangent is passed on."""
  bwd_out = BWD_OUTPUTS[case]
  outcomes = {}
  for name, impl in IMPLS.items():
    f = _make(impl, bwd_out)
    with jax.disable_bwd_checks(True) if hasattr(jax, "disable_bwd_checks") \
        else _disable_bwd_checks():
      outcomes[name] = {p: _outcome(lambda: PATHS[p](f)(A, T, N, B))
                        for p in ("eager", "jit")}
  for p in ("eager", "jit"):
    assert outcomes["jax"][p][0] == "ok"
    _assert_same(outcomes["jax"][p], outcomes["smart"][p])


def _disable_bwd_checks():
  from jax._src import config
  return config.disable_bwd_checks(True)


def test_disable_bwd_checks_is_read_at_each_trace():
  """A cached trace of bwd made with the checks on must not let a wrong
  cotangent through later, and the other way round."""
  f = _make(smart_custom_vjp, BWD_OUTPUTS["wrong_shape"])
  run = PATHS["eager"](f)
  with pytest.raises(ValueError):
    jax.jit(run)(A, T, N, B)
  with _disable_bwd_checks():
    out = jax.jit(run)(A, T, N, B)
  assert out[0].shape == (3,)
  with pytest.raises(ValueError):
    jax.jit(run)(A, T, N, B)


# -- gradient dtypes on every path ---------------------------------------------

def _dtype_fn(impl, ct_dtype):
  @impl
  def f(x, n):
    return x * 3, n

  def f_fwd(x, n):
    return f(x, n), x

  def f_bwd(x, g):
    gx, _ = g
    return (gx * 3).astype(ct_dtype), jnp.ones(n_shape, jnp.float32)

  n_shape = (2,)
  f.defvjp(f_fwd, f_bwd)
  return f


def _loss(f):
  def loss(x, n):
    y, m = f(x, n)
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(m).astype(jnp.float32) * 0
  return loss


def _scan_loss(f):
  def loss(x, n):
    def body(c, xi):
      y, _ = f(xi, n)
      return c + jnp.sum(y.astype(jnp.float32)), None
    return jax.lax.scan(body, jnp.float32(0), x)[0]
  return loss


_SAVE = jax.checkpoint_policies.everything_saveable
_NAMES = jax.checkpoint_policies.save_only_these_names("nothing")
DTYPE_PATHS = {
    "eager": lambda f: jax.grad(_loss(f), argnums=(0, 1), allow_int=True),
    "jit": lambda f: jax.jit(jax.grad(_loss(f), argnums=(0, 1),
                                      allow_int=True)),
    "remat": lambda f: jax.grad(_loss(jax.checkpoint(f)), argnums=(0, 1),
                                allow_int=True),
    "remat_saving": lambda f: jax.jit(jax.grad(
        _loss(jax.checkpoint(f, policy=_SAVE)), argnums=(0, 1),
        allow_int=True)),
    "remat_names": lambda f: jax.jit(jax.grad(
        _loss(jax.checkpoint(f, policy=_NAMES)), argnums=(0, 1),
        allow_int=True)),
    "vmap": lambda f: jax.vmap(jax.grad(_loss(f), argnums=(0, 1),
                                        allow_int=True), in_axes=(0, None)),
    "scan": lambda f: jax.grad(_scan_loss(f), argnums=(0, 1), allow_int=True),
}


@pytest.mark.parametrize("path", list(DTYPE_PATHS))
@pytest.mark.parametrize("in_dtype,ct_dtype", [
    (jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
    (jnp.float32, jnp.bfloat16), (jnp.float16, jnp.float32),
    (jnp.bfloat16, jnp.float16), (jnp.float16, jnp.bfloat16)])
def test_gradient_dtypes_match_jax(path, in_dtype, ct_dtype):
  """``bwd``'s cotangent dtype reaches the gradient as with jax.custom_vjp;
  the integer input's gradient is float0 on both."""
  x = (jnp.arange(6.0).reshape(3, 2) / 4).astype(in_dtype)
  n = jnp.arange(2, dtype=jnp.int32)
  expected = DTYPE_PATHS[path](_dtype_fn(jax.custom_vjp, ct_dtype))(x, n)
  got = DTYPE_PATHS[path](_dtype_fn(smart_custom_vjp, ct_dtype))(x, n)
  assert expected[1].dtype == jax.dtypes.float0
  _assert_same(("ok", list(expected)), ("ok", list(got)))


def test_other_precision_inside_two_calls_jitted_with_saving_policy():
  """Two custom functions under jit and an always-save policy: a bfloat16
  matmul whose bwd returns its cotangent as given, then an upcast to float32
  whose bwd returns float32 for the bfloat16 input (its residual). The
  cotangent stays float32 through both bwds, with jax.custom_vjp's values."""

  def build(impl):
    @impl
    def square(x):
      return x @ x

    square.defvjp(lambda x: (square(x), None), lambda _, g: (g,))

    @impl
    def upcast(x):
      return x.astype(jnp.float32) * jnp.float32(1.0)

    upcast.defvjp(lambda x: (upcast(x), x),
                  lambda x, _: (x.astype(jnp.float32) * jnp.float32(1.0),))

    @jax.jit
    @functools.partial(jax.checkpoint, policy=lambda *_, **__: True)
    def program(x):
      return upcast(square(x))
    return program

  eps = jnp.finfo(jnp.bfloat16).eps
  x = (jnp.bfloat16(1) + eps) * jnp.eye(2, dtype=jnp.bfloat16)
  results = {}
  for name, impl in IMPLS.items():
    y, vjp = jax.vjp(build(impl), x)
    (ct,) = vjp(jnp.ones_like(y))
    results[name] = (y, ct)
  (y_jax, ct_jax), (y, ct) = results["jax"], results["smart"]
  assert ct.dtype == ct_jax.dtype == jnp.float32
  assert y.dtype == y_jax.dtype
  np.testing.assert_array_equal(np.asarray(ct), np.asarray(ct_jax))


# -- pytrees --------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["jax", "smart"])
def test_user_pytrees_are_never_rebuilt_with_none_children(impl):
  f = IMPLS[impl](lambda x: x[0])
  f.defvjp(lambda x: (x[0], None), lambda _, g: (NoNones([g]),))
  grad = jax.grad(f)(NoNones([jnp.float32(1.0)]))
  assert isinstance(grad, NoNones) and float(grad[0]) == 1.0


@pytest.mark.parametrize("bare", [False, True])
def test_custom_pytree_with_symbolic_zeros(bare):
  """symbolic_zeros=True with a custom-pytree argument: fwd sees
  CustomVJPPrimal leaves inside the Box, bwd may answer for the Box with a
  bare value or a Box."""
  values = jax.custom_derivatives.custom_vjp_primal_tree_values
  seen = {}

  def build(impl, name):
    @impl
    def f(box, y):
      return box.value * y

    def f_fwd(box, y):
      seen[name] = (box.value.perturbed, y.perturbed)
      box, y = values(box), values(y)
      return f(box, y), (box, y)

    def f_bwd(res, g):
      box, y = res
      return (y * g if bare else Box(y * g)), box.value * g

    f.defvjp(f_fwd, f_bwd, symbolic_zeros=True)
    return f

  x, y = Box(jnp.float32(2.0)), jnp.float32(5.0)
  for argnums in (0, 1, (0, 1)):
    grads = {}
    for name, impl in IMPLS.items():
      grads[name] = _outcome(lambda: jax.grad(build(impl, name),
                                              argnums=argnums)(x, y))
      assert seen[name] == seen["jax"]
    _assert_same(grads["jax"], grads["smart"])


# -- tracebacks and source lines -------------------------------------------------

class _RuleFailed(Exception):
  pass


@pytest.mark.parametrize("which", ["fwd", "bwd"])
@pytest.mark.parametrize("path", ["grad", "jit", "remat"])
def test_traceback_of_error_in_rule_shows_user_frames_like_jax(which, path):
  """With JAX's traceback filtering, the user's rule frame is kept and the
  library's frames are dropped, for smartvjp as for jax.custom_vjp."""

  def build(impl):
    @impl
    def f(x):
      return jnp.sin(x)

    def user_fwd_rule(x):
      if which == "fwd":
        raise _RuleFailed()
      return jnp.sin(x), x

    def user_bwd_rule(x, g):
      raise _RuleFailed()

    f.defvjp(user_fwd_rule, user_bwd_rule)
    return f

  programs = {
      "grad": lambda f: jax.grad(lambda x: jnp.sum(f(x))),
      "jit": lambda f: jax.jit(jax.grad(lambda x: jnp.sum(f(x)))),
      "remat": lambda f: jax.jit(jax.grad(
          lambda x: jnp.sum(jax.checkpoint(f)(x)))),
  }
  frames = {}
  for name, impl in IMPLS.items():
    with pytest.raises(_RuleFailed) as info:
      programs[path](build(impl))(jnp.ones(3))
    frames[name] = traceback.extract_tb(info.value.__traceback__)
  smart_names = [fr.name for fr in frames["smart"]]
  assert f"user_{which}_rule" in smart_names
  assert not any(os.path.abspath(fr.filename).startswith(PACKAGE_DIR)
                 for fr in frames["smart"]), \
      traceback.format_list(frames["smart"])
  assert len(frames["smart"]) == len(frames["jax"])


def test_print_saved_residuals_names_residual_and_user_line(capsys):
  """A residual that fwd names with checkpoint_name is reported by that name
  and the user's source line, as for jax.custom_vjp."""
  from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

  def build(impl):
    @impl
    def f(x):
      return jnp.sin(x)

    def f_fwd(x):
      return jnp.sin(x), checkpoint_name(jnp.cos(x), "cos_of_x")

    f.defvjp(f_fwd, lambda c, g: (g * c,))
    return f

  policy = jax.checkpoint_policies.save_only_these_names("cos_of_x")
  printed = {}
  for name, impl in IMPLS.items():
    f = build(impl)
    program = jax.checkpoint(lambda x: f(x) * 2.0, policy=policy)
    print_saved_residuals(program, jnp.ones(3))
    printed[name] = capsys.readouterr().out
  assert "named 'cos_of_x'" in printed["jax"]
  assert printed["smart"] == printed["jax"]
  # nothing of smartvjp's own shows: no primitive name, no file of the package
  # (this test file's path may contain "smartvjp", as a clone's folder does)
  assert "smartvjp" not in printed["smart"].replace(__file__, "")
  assert PACKAGE_DIR not in printed["smart"]
