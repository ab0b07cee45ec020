"""The swap API: ``smartvjp.import_swapped``, ``smartvjp.swap_custom_vjp``,
``smartvjp.swap_report``, on small libraries written for each test (every
way a module can reach ``jax.custom_vjp``), compared bit for bit with the
unswapped library. JAX's shipped Pallas kernels: ``test_pallas_ops.py``; the
real libraries of ``tests/ports``: ``tests/ports/test_import_swapped.py``."""

from __future__ import annotations

import importlib
import sys
import textwrap
import threading
import uuid

import jax
import jax.custom_derivatives
import jax.numpy as jnp
import numpy as np
import pytest

import smartvjp
from smartvjp import (
    SwapError, import_swapped, smart_custom_vjp, swap_custom_vjp, swap_report)

JAX_CUSTOM_VJP = jax.custom_vjp

# A library that reaches jax.custom_vjp in every way a module can: module-level
# decorators of each spelling, a partial with nondiff_argnums, a decorator
# kept for later, jax.custom_vjp called when a function runs, a jitted
# custom_vjp function, a class attribute and an object holding one.
LIBRARY = '''
import functools
import jax
import jax.numpy as jnp
import jax.custom_derivatives as cd
from jax import custom_vjp
from jax.custom_derivatives import custom_vjp as cd_custom_vjp


def _rules():
  def fwd(x):
    return jnp.sin(x), jnp.cos(x)

  def bwd(c, g):
    return (c * g,)
  return fwd, bwd


@jax.custom_vjp
def attribute(x):
  return jnp.sin(x)
attribute.defvjp(*_rules())


@custom_vjp
def from_import(x):
  return jnp.sin(x)
from_import.defvjp(*_rules())


@cd.custom_vjp
def module_alias(x):
  return jnp.sin(x)
module_alias.defvjp(*_rules())


@cd_custom_vjp
def from_custom_derivatives(x):
  return jnp.sin(x)
from_custom_derivatives.defvjp(*_rules())


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def scaled(x, n):
  return jnp.sin(x) * n


def _scaled_fwd(x, n):
  return jnp.sin(x) * n, jnp.cos(x)


def _scaled_bwd(n, c, g):
  return (c * g * n,)
scaled.defvjp(_scaled_fwd, _scaled_bwd)

later = functools.partial(jax.custom_vjp, nondiff_argnums=(1,))


def made_at_call_time():
  f = jax.custom_vjp(lambda x: jnp.sin(x))
  f.defvjp(*_rules())
  return f


jitted = jax.jit(attribute)


class Holder:
  op = attribute


class Box:
  def __init__(self, op):
    self.op = op


box = Box(from_import)
'''

FUNCTIONS = ("attribute", "from_import", "module_alias",
             "from_custom_derivatives", "jitted")


@pytest.fixture
def library(tmp_path, monkeypatch):
  """``write(source, name=None) -> module name``: writes a module (or, with
  a dict, a package ``{relative path: source}``) under a unique name into a
  folder on ``sys.path``; its modules leave ``sys.modules`` after the test."""
  monkeypatch.syspath_prepend(str(tmp_path))
  names = []

  def write(source, name=None):
    name = name or f"swaplib_{uuid.uuid4().hex[:10]}"
    files = source if isinstance(source, dict) else {"": source}
    for rel, text in files.items():
      path = tmp_path / name / rel if rel else tmp_path / f"{name}.py"
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(textwrap.dedent(text))
    names.append(name)
    importlib.invalidate_caches()
    return name

  yield write
  for mod in list(sys.modules):
    if any(mod == n or mod.startswith(n + ".") for n in names):
      del sys.modules[mod]


def bits(x):
  a = np.asarray(x)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bitwise(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(bits(x), bits(y))


def checkpointed_grad(f, *static):
  return jax.jit(jax.grad(lambda x: jnp.sum(
      jax.checkpoint(lambda x: f(x, *static))(x) ** 2)))


def primitives(fn, *args):
  """(smartvjp's primitives, JAX's custom_vjp_call) in the jaxpr of ``fn``
  (a primal program: after ``jax.grad`` JAX's primitive is gone)."""
  text = str(jax.make_jaxpr(lambda *a: fn(*a))(*args))   # never a cached trace
  return "smartvjp_" in text, "custom_vjp_call" in text


X = jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float32)


# -- import_swapped ------------------------------------------------------------

def test_import_swapped_reaches_every_spelling(library):
  name = library(LIBRARY)
  shared = importlib.import_module(name)
  copy = import_swapped(name)
  assert copy is not shared and sys.modules[name] is shared
  report = swap_report(copy)
  expected = {f"{name}.{n}" for n in FUNCTIONS} | {
      f"{name}.scaled", f"{name}.later", f"{name}.custom_vjp",
      f"{name}.cd_custom_vjp", f"{name}.made_at_call_time",
      f"{name}.Holder.op", f"{name}.box.op"}
  assert set(report) == expected and all(report.values()), report
  theirs = swap_report(shared)
  assert set(theirs) == expected and not any(theirs.values()), theirs
  for fn in FUNCTIONS:
    ours, jaxs = getattr(copy, fn), getattr(shared, fn)
    assert primitives(jax.checkpoint(ours), X) == (True, False), fn
    assert primitives(jax.checkpoint(jaxs), X) == (False, True), fn
    assert_bitwise(checkpointed_grad(ours)(X), checkpointed_grad(jaxs)(X))


def test_partial_with_nondiff_argnums_and_call_time_decorators(library):
  name = library(LIBRARY)
  shared = importlib.import_module(name)
  copy = import_swapped(name)
  # the module-level partial: smartvjp's, nondiff argument passed to bwd first
  assert isinstance(copy.scaled, smartvjp.smart_custom_vjp)
  assert copy.scaled.nondiff_argnums == (1,)
  assert_bitwise(checkpointed_grad(copy.scaled, 3.0)(X),
                 checkpointed_grad(shared.scaled, 3.0)(X))
  np.testing.assert_allclose(checkpointed_grad(copy.scaled, 3.0)(X),
                             2 * 9.0 * jnp.sin(X) * jnp.cos(X), rtol=1e-6)
  # a partial kept for later use, and jax.custom_vjp called when a function
  # of the copy runs, long after import_swapped returned
  late = copy.later(lambda x, n: x * n)
  assert isinstance(late, smartvjp.smart_custom_vjp)
  assert late.nondiff_argnums == (1,)
  assert isinstance(copy.made_at_call_time(), smartvjp.smart_custom_vjp)
  assert isinstance(shared.made_at_call_time(), JAX_CUSTOM_VJP)
  assert_bitwise(checkpointed_grad(copy.made_at_call_time())(X),
                 checkpointed_grad(shared.made_at_call_time())(X))


def test_import_swapped_changes_nothing_global(library):
  name = library(LIBRARY)
  assert name not in sys.modules
  meta_path = list(sys.meta_path)
  copy = import_swapped(name)
  assert swap_report(copy)[f"{name}.attribute"]
  assert name not in sys.modules, "the copy must not stay in sys.modules"
  assert sys.meta_path == meta_path
  assert jax.custom_vjp is JAX_CUSTOM_VJP
  assert jax.custom_derivatives.custom_vjp is JAX_CUSTOM_VJP
  # a plain import afterwards is JAX's, as if nothing happened
  shared = importlib.import_module(name)
  assert shared is not copy and not swap_report(shared)[f"{name}.attribute"]
  # each call makes a new copy
  again = import_swapped(name)
  assert again is not copy and swap_report(again)[f"{name}.attribute"]


PACKAGE = {
    "__init__.py": """
        from . import kernels
        from .kernels import op
        from .layers import apply
        """,
    "kernels.py": """
        import jax, jax.numpy as jnp

        @jax.custom_vjp
        def op(x):
          return jnp.tanh(x)

        def _fwd(x):
          y = jnp.tanh(x)
          return y, y

        def _bwd(y, g):
          return (g * (1 - y * y),)
        op.defvjp(_fwd, _bwd)
        """,
    "layers.py": """
        from .kernels import op

        def apply(x):
          return op(x) * 2
        """,
}


def test_a_package_is_copied_with_its_submodules(library):
  name = library(PACKAGE)
  shared = importlib.import_module(name)
  copy = import_swapped(name)
  report = swap_report(copy)
  assert report[f"{name}.op"] and report[f"{name}.kernels.op"], report
  assert copy.kernels is not shared.kernels
  assert copy.layers.op is copy.kernels.op       # one copy, shared inside it
  assert sys.modules[f"{name}.kernels"] is shared.kernels
  assert not swap_report(shared)[f"{name}.kernels.op"]
  assert_bitwise(checkpointed_grad(copy.apply)(X),
                 checkpointed_grad(shared.apply)(X))
  # a submodule alone: the parent package stays the shared one, and keeps
  # its attribute pointing at the shared submodule
  sub = import_swapped(f"{name}.kernels")
  assert swap_report(sub)[f"{name}.kernels.op"]
  assert shared.kernels is sys.modules[f"{name}.kernels"]


def test_a_package_imported_first_by_the_swap_keeps_its_own_names(library):
  """The package is not imported yet and its __init__ imports the module to
  be copied: the package (shared) must bind the shared module's function,
  never the copy's."""
  name = library(PACKAGE)
  assert name not in sys.modules
  copy = import_swapped(f"{name}.kernels")
  shared = sys.modules[name]
  assert swap_report(copy)[f"{name}.kernels.op"]
  report = swap_report(shared)
  assert report[f"{name}.op"] is False and report[f"{name}.kernels.op"] is False
  assert shared.kernels is sys.modules[f"{name}.kernels"] is not copy


def test_a_module_that_needs_its_package_mid_init_is_copied_with_it(library):
  """Like JAX's megablox: ops.py reads the submodule ``backend`` from its
  package while the package's __init__ runs, before the __init__ rebinds
  that name to a function. Copying ops.py alone then fails in ops.py's own
  code; copying the package runs both in the original order."""
  name = library({
      "__init__.py": "from .ops import backend\n",
      "backend.py": "def backend(x):\n  return x\n",
      "ops.py": """
          import jax
          from . import backend as _backend_module
          op = jax.custom_vjp(_backend_module.backend)
          op.defvjp(lambda x: (x, None), lambda _, g: (g,))
          backend = op
          """,
  })
  importlib.import_module(name)
  with pytest.raises(AttributeError):
    import_swapped(f"{name}.ops")
  copy = import_swapped(name)
  assert swap_report(copy) == {f"{name}.backend": True,
                               f"{name}.ops.backend": True,
                               f"{name}.ops.op": True}


def test_custom_vjp_from_a_shared_module_needs_include(library):
  dep = library(PACKAGE)
  user = library(f"""
      import jax.numpy as jnp
      from {dep}.kernels import op

      def model(x):
        return jnp.sum(op(x) ** 2)
      """)
  importlib.import_module(dep)
  with pytest.raises(SwapError, match=rf"{user}\.op .*made in {dep}\.kernels"
                     rf".*include="):
    import_swapped(user)
  copy = import_swapped(user, include=(dep,))
  assert swap_report(copy) == {f"{user}.op": True}
  assert swap_report(sys.modules[dep])[f"{dep}.op"] is False   # untouched
  include_one = import_swapped(user, include=f"{dep}.kernels")
  assert swap_report(include_one) == {f"{user}.op": True}


def test_private_import_of_custom_vjp_is_refused(library):
  name = library("""
      import jax.numpy as jnp
      from jax._src.custom_derivatives import custom_vjp

      @custom_vjp
      def f(x):
        return jnp.sin(x)
      """)
  with pytest.raises(SwapError, match=r"from jax\._src\.custom_derivatives "
                     r"import custom_vjp.*public names"):
    import_swapped(name)
  assert name not in sys.modules


def test_a_decorator_reached_another_way_is_refused(library):
  name = library("""
      import importlib
      import jax.numpy as jnp
      custom_vjp = importlib.import_module("jax").custom_vjp   # not an import

      @custom_vjp
      def f(x):
        return jnp.sin(x)
      """)
  with pytest.raises(SwapError, match=rf"{name}\.custom_vjp .*{name}\.f .*"
                     r"name the swap does not cover"):
    import_swapped(name)


def test_jax_experimental_rnn_is_refused_with_the_reason():
  """JAX's own LSTM binds custom_vjp from jax._src: refused, and nothing of
  the attempt stays behind."""
  before = sys.modules.get("jax.experimental.rnn")
  with pytest.raises(SwapError, match="jax.experimental.rnn runs `from "
                     r"jax\._src\.custom_derivatives import custom_vjp`"):
    import_swapped("jax.experimental.rnn")
  assert sys.modules.get("jax.experimental.rnn") is before


@pytest.mark.parametrize("name", ["jax", "jax._src.core", "jaxlib",
                                  "jaxlib.xla_client", "smartvjp",
                                  "smartvjp._api", "jax.custom_derivatives"])
def test_core_modules_are_never_copied(name):
  with pytest.raises(SwapError, match="never re-executes"):
    import_swapped(name)
  with pytest.raises(SwapError, match="never re-executes"):
    import_swapped("jax.experimental.ode", include=(name,))


@pytest.mark.parametrize("bad", ["", ".relative", "a..b", "a.1b", 3, None])
def test_bad_names_are_value_errors(bad):
  with pytest.raises(ValueError, match="absolute module name"):
    import_swapped(bad)


def test_missing_module_and_modules_without_source():
  with pytest.raises(ModuleNotFoundError):
    import_swapped("smartvjp_no_such_module_here")
  for name in ("math", "sys", "_json"):   # built-in or extension
    with pytest.raises(SwapError, match="no Python source"):
      import_swapped(name)


def test_an_error_in_the_module_propagates_and_cleans_up(library):
  name = library({"__init__.py": "from . import good, bad\n",
                  "good.py": "import jax\nop = jax.custom_vjp(abs)\n",
                  "bad.py": "raise RuntimeError('broken on purpose')\n"})
  meta_path = list(sys.meta_path)
  with pytest.raises(RuntimeError, match="broken on purpose"):
    import_swapped(name)
  assert not [m for m in sys.modules if m.startswith(name)]
  assert sys.meta_path == meta_path


def test_import_swapped_from_threads(library):
  name = library(LIBRARY)
  shared = importlib.import_module(name)
  copies, errors = [], []

  def work():
    try:
      copies.append(import_swapped(name))
    except Exception as e:   # noqa: BLE001
      errors.append(e)
  threads = [threading.Thread(target=work) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  assert len({id(c) for c in copies}) == 4
  assert all(swap_report(c)[f"{name}.attribute"] for c in copies)
  assert sys.modules[name] is shared


# -- swap_custom_vjp -------------------------------------------------------------

def test_swap_custom_vjp_patches_both_names_and_restores():
  with swap_custom_vjp():
    assert jax.custom_vjp is smartvjp.smart_custom_vjp
    assert jax.custom_derivatives.custom_vjp is smartvjp.smart_custom_vjp
  assert jax.custom_vjp is JAX_CUSTOM_VJP
  assert jax.custom_derivatives.custom_vjp is JAX_CUSTOM_VJP


def test_restored_on_an_exception():
  with pytest.raises(KeyError, match="inside"):
    with swap_custom_vjp():
      raise KeyError("inside")
  assert jax.custom_vjp is JAX_CUSTOM_VJP
  assert jax.custom_derivatives.custom_vjp is JAX_CUSTOM_VJP


def test_nesting_and_decorator_use():
  with swap_custom_vjp():
    with swap_custom_vjp():
      assert jax.custom_vjp is smartvjp.smart_custom_vjp
    assert jax.custom_vjp is smartvjp.smart_custom_vjp  # the inner exit keeps it
  assert jax.custom_vjp is JAX_CUSTOM_VJP

  @swap_custom_vjp()
  def decorate():
    return jax.custom_vjp(jnp.sin)
  assert isinstance(decorate(), smartvjp.smart_custom_vjp)
  assert isinstance(decorate(), smartvjp.smart_custom_vjp)   # reusable
  assert jax.custom_vjp is JAX_CUSTOM_VJP


def test_first_import_in_the_block_is_swapped_an_earlier_one_is_not(library):
  name = library(LIBRARY)
  with swap_custom_vjp():
    swapped = importlib.import_module(name)
  report = swap_report(swapped)
  for fn in FUNCTIONS + ("scaled", "later", "custom_vjp", "cd_custom_vjp"):
    assert report[f"{name}.{fn}"], fn
  # after the block: module-level decorators stay smartvjp's; jax.custom_vjp
  # looked up at call time is JAX's again, and the report says so
  assert report[f"{name}.made_at_call_time"] is False
  assert "existing=True" in report.why[f"{name}.made_at_call_time"]
  assert isinstance(swapped.made_at_call_time(), JAX_CUSTOM_VJP)
  with swap_custom_vjp():
    assert isinstance(swapped.made_at_call_time(), smartvjp.smart_custom_vjp)
  assert_bitwise(checkpointed_grad(swapped.scaled, 2.0)(X),
                 checkpointed_grad(import_swapped(name).scaled, 2.0)(X))
  # an import of a module imported before the block is Python's cached one
  other = library(LIBRARY)
  before = importlib.import_module(other)
  with swap_custom_vjp():
    again = importlib.import_module(other)
  assert again is before and not swap_report(again)[f"{other}.attribute"]


def test_a_trace_cached_in_the_block_keeps_smartvjp():
  def f(x):
    g = jax.custom_vjp(jnp.sin)
    g.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, t: (c * t,))
    return jax.checkpoint(g)(x)
  grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x))))
  with swap_custom_vjp():
    inside = grad(X)
    assert primitives(f, X) == (True, False)
    assert "smartvjp_" in str(grad.trace(X).jaxpr)
  assert primitives(f, X) == (False, True)   # traced anew: JAX's
  assert_bitwise(grad(X), inside)            # the cached program, smartvjp's
  assert grad._cache_size() == 1


def test_replaced_inside_the_block_is_a_swap_error():
  foreign = object()
  with pytest.raises(SwapError, match="jax.custom_vjp was replaced by"):
    with swap_custom_vjp():
      jax.custom_vjp = foreign
  assert jax.custom_vjp is JAX_CUSTOM_VJP
  assert jax.custom_derivatives.custom_vjp is JAX_CUSTOM_VJP
  with pytest.raises(SwapError) as info:
    with swap_custom_vjp():
      jax.custom_derivatives.custom_vjp = foreign
      raise KeyError("first")
  assert isinstance(info.value.__context__, KeyError)
  assert jax.custom_derivatives.custom_vjp is JAX_CUSTOM_VJP


def test_blocks_in_two_threads_run_one_after_the_other():
  entered, release, order = threading.Event(), threading.Event(), []

  def first():
    with swap_custom_vjp():
      order.append("first in")
      entered.set()
      release.wait(10)
      order.append("first out")

  def second():
    entered.wait(10)
    with swap_custom_vjp():
      order.append("second in")
      assert jax.custom_vjp is smartvjp.smart_custom_vjp
    order.append("second out")

  seen = []
  t1, t2 = threading.Thread(target=first), threading.Thread(target=second)
  t1.start()
  t2.start()
  entered.wait(10)
  seen.append(jax.custom_vjp)   # another thread sees the process-wide swap
  release.set()
  t1.join(10)
  t2.join(10)
  assert order == ["first in", "first out", "second in", "second out"]
  assert seen == [smartvjp.smart_custom_vjp]
  assert jax.custom_vjp is JAX_CUSTOM_VJP


# -- swap_report -------------------------------------------------------------------

def test_swap_report_rejects_what_it_cannot_report_on(library):
  with pytest.raises(TypeError, match="expected a module or a function"):
    swap_report(3)
  module = importlib.import_module(library("X = 1\n"))
  with pytest.raises(TypeError, match="arguments are for a function"):
    swap_report(module, X)


def test_swap_report_of_a_module_without_custom_vjp(library):
  name = library("import math\nX = 1\n")
  report = swap_report(importlib.import_module(name))
  assert report == {} and not report.ok
  assert str(report).startswith("no custom rules found")


def _sin_rules(make):
  if make is None:   # no custom rules
    return jnp.sin
  F = make(jnp.sin)
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  return F


@pytest.mark.parametrize("form", ["loss", "grad", "value_and_grad",
                                  "checkpointed_grad"])
def test_swap_report_tells_the_three_cases_apart(form):
  """Issue 56: swapped (also once differentiated: smartvjp's rules are
  seen in the gradient's program), not swapped (named), no custom rules."""
  x = jnp.ones(3, jnp.float32)

  def program(F):
    loss = lambda x: jnp.sum(F(x) ** 2)
    return {"loss": loss, "grad": jax.grad(loss),
            "value_and_grad": jax.value_and_grad(loss),
            "checkpointed_grad": jax.grad(jax.checkpoint(loss))}[form]

  smart = swap_report(program(_sin_rules(smart_custom_vjp)), x)
  assert smart.ok and list(smart.values()) == [True], smart
  assert str(smart).splitlines()[0].startswith("swapped: all 1 custom rule")
  theirs = swap_report(program(_sin_rules(jax.custom_vjp)), x)
  none = swap_report(program(_sin_rules(None)), x)
  assert not none and not none.ok
  assert str(none).startswith("no custom rules found")
  assert "pass the function before differentiating it" in str(none)
  if form == "loss":
    assert not theirs.ok and list(theirs.values()) == [False]
    first = str(theirs).splitlines()[0]
    assert first.startswith("not swapped: 1 jax.custom_vjp call") and "sin" in first
  else:   # a jax.custom_vjp call is inlined once differentiated
    assert not theirs and str(theirs) == str(none)


# what a user differentiates: a package whose public function reaches its
# kernels in the ways the swap cannot see from the module (a submodule
# imported inside the function, a custom_gradient), and one that reaches
# them at import time
USER_PACKAGE = {
    "__init__.py": "",
    "kernels.py": LIBRARY,
    "api.py": """
        import jax
        import jax.numpy as jnp


        @jax.custom_gradient
        def clip_gradient(x):
          return x, lambda g: (jnp.clip(g, -1.0, 1.0),)


        def eager_path(x):
          from . import kernels     # imported when the function runs
          return kernels.attribute(x)


        def gradient_path(x):
          return clip_gradient(x)
        """,
    "model.py": """
        import jax
        from . import kernels


        def loss(x):
          y = jax.lax.scan(lambda c, _: (kernels.attribute(c), None), x,
                           None, length=2)[0]
          return jax.jit(jax.checkpoint(kernels.from_import))(y).sum()
        """,
}


def test_swap_report_of_a_program_finds_every_call_and_says_why(library,
                                                                ad_mode):
  name = library(USER_PACKAGE)
  model = import_swapped(f"{name}.model", include=(f"{name}.kernels",))
  report = swap_report(model.loss, X)
  assert report == {f"{name}.kernels.attribute": True,
                    f"{name}.kernels.from_import": True}, report
  assert report.ok and report.why == {}
  # the same program unswapped: each call is JAX's, and the report says why
  shared = importlib.import_module(f"{name}.model")
  theirs = swap_report(shared.loss, X)
  assert set(theirs) == set(report) and not any(theirs.values())
  for key in theirs:
    why = theirs.why[key]
    assert f"{name}.kernels as the process imported it" in why, why
    assert "swap_custom_vjp(existing=True)" in why
  assert "JAX" in str(theirs) and f"{name}.kernels.attribute" in str(theirs)


def test_swap_report_of_a_program_sees_what_the_module_report_misses(library):
  name = library(USER_PACKAGE)
  # a jax.custom_gradient (a jax.custom_vjp JAX makes in its private
  # modules) does not stop the copy: no swap reaches it, and the reports say so
  api = import_swapped(f"{name}.api", include=(f"{name}.kernels",))
  inventory = swap_report(api)
  assert inventory[f"{name}.api.clip_gradient"] is False, inventory
  assert "jax.custom_gradient" in inventory.why[f"{name}.api.clip_gradient"]
  # a module the copy imports inside a function, when it runs: the copy's
  # own where include= names it, and the report says so where it does not
  lazy = swap_report(api.eager_path, X)
  assert lazy == {f"{name}.kernels.attribute": True} and lazy.ok, lazy
  alone = import_swapped(f"{name}.api", include=(f"{name}.model",))
  shared = swap_report(alone.eager_path, X)
  assert shared == {f"{name}.kernels.attribute": False}, shared
  assert "not in include=" in shared.why[f"{name}.kernels.attribute"]
  gradient = swap_report(api.gradient_path, X)
  assert list(gradient.values()) == [False], gradient
  (why,) = gradient.why.values()
  assert "jax.custom_gradient" in why


def test_swap_report_after_swap_custom_vjp_tells_the_truth(library):
  name = library(LIBRARY)
  with swap_custom_vjp():
    swapped = importlib.import_module(name)
  inventory = swap_report(swapped)
  # every decorated function is smartvjp's; the function that calls
  # jax.custom_vjp when it runs gets JAX's again, and the report says so
  assert inventory.pop(f"{name}.made_at_call_time") is False
  assert all(inventory.values()) and f"{name}.attribute" in inventory
  program = swap_report(lambda x: swapped.attribute(x) + swapped.scaled(x, 2.0),
                        X)
  assert program.ok and set(program) == {f"{name}.attribute",
                                         f"{name}.scaled"}, program
  late = swap_report(lambda x: swapped.made_at_call_time()(x), X)
  assert list(late.values()) == [False], late
  (why,) = late.why.values()
  assert "after the swap_custom_vjp() block" in why and "existing=True" in why
  with swap_custom_vjp(existing=True):
    assert swap_report(lambda x: swapped.made_at_call_time()(x), X).ok


def test_swap_report_of_a_program_nested_in_a_smart_function(library):
  name = library(LIBRARY)
  shared = importlib.import_module(name)

  @smartvjp.smart_custom_vjp
  def outer(x):
    return shared.attribute(x) * 2.0
  outer.defvjp(lambda x: (outer(x), x), lambda x, g: (g,))
  report = swap_report(jax.jit(outer), jax.ShapeDtypeStruct((7,), jnp.float32))
  assert report[f"{__name__}.outer"] is True
  assert report[f"{name}.attribute"] is False


# -- swap_custom_vjp(existing=True) ------------------------------------------------

# a library imported once, as the process imported it (it registers a pytree
# node at import: tesseract_jax does, and a second import of it fails)
REGISTERING = LIBRARY + '''

@jax.tree_util.register_pytree_node_class
class Pair:
  def __init__(self, a, b):
    self.a, self.b = a, b

  def tree_flatten(self):
    return (self.a, self.b), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children)


def on_pair(p):
  return attribute(p.a) * scaled(p.b, 3.0)
'''


def test_existing_functions_run_as_smart_inside_the_block(library):
  name = library(REGISTERING)
  lib = importlib.import_module(name)
  pair = lambda x: lib.Pair(x, 2.0 * x)
  loss = lambda x: jnp.sum(lib.on_pair(pair(x)))
  before = swap_report(loss, X)
  assert set(before) == {f"{name}.attribute", f"{name}.scaled"}
  assert not any(before.values())
  expected = checkpointed_grad(loss)(X)
  with swap_custom_vjp(existing=True):
    report = swap_report(loss, X)
    got = jax.jit(jax.grad(lambda x: jnp.sum(
        jax.checkpoint(loss)(x) ** 2)))(X)
    assert swap_report(jax.checkpoint(loss), X).ok
    assert isinstance(lib.attribute, JAX_CUSTOM_VJP)   # the objects stay
  assert report.ok and set(report) == set(before), report
  assert_bitwise(got, expected)
  # outside the block, JAX's again (for a function traced anew: jax.checkpoint
  # keeps the trace of loss it made inside the block, as jax.jit would)
  after = swap_report(jax.checkpoint(lambda x: loss(x)), X)
  assert set(after) == set(before) and not any(after.values()), after


def test_existing_leaves_jax_own_and_unconvertible_functions_alone(library):
  no_rules = jax.custom_vjp(jnp.sin)   # defvjp never called
  grad_clip = jax.custom_gradient(lambda x: (x, lambda g: (jnp.clip(g, -1, 1),)))
  with swap_custom_vjp(existing=True):
    report = swap_report(lambda x: grad_clip(x) * 2.0, X)
    assert list(report.values()) == [False]   # JAX's own: left alone
    with pytest.raises(Exception) as e1:
      no_rules(X)
  with pytest.raises(type(e1.value)):
    no_rules(X)   # the same error as JAX's own call


def test_existing_blocks_nest_and_restore_jax_call(library):
  name = library(LIBRARY)
  lib = importlib.import_module(name)
  jax_call = JAX_CUSTOM_VJP.__call__
  with swap_custom_vjp():
    with swap_custom_vjp(existing=True):
      with swap_custom_vjp(existing=True):
        pass
      assert swap_report(lib.attribute, X).ok
    assert JAX_CUSTOM_VJP.__call__ is jax_call
    assert not swap_report(lib.attribute, X).ok
  assert JAX_CUSTOM_VJP.__call__ is jax_call and jax.custom_vjp is JAX_CUSTOM_VJP


# -- issue 34: the forms the seven libraries needed ---------------------------------

def test_include_reaches_a_submodule_imported_from_its_package(library):
  """``from pkg import sub`` with ``pkg.sub`` in include= and ``pkg``
  shared (TFP's ``from ...internal import custom_gradient``): the copy's
  sub, at import and inside a function that runs later."""
  name = library({
      "__init__.py": "",
      "lib/__init__.py": "from . import kernels\n",
      "lib/kernels.py": LIBRARY,
      "user.py": """
          from .lib import kernels

          def eager(x):
            return kernels.attribute(x)

          def lazy(x):
            from .lib import kernels as again
            return again.scaled(x, 2.0)
          """,
  })
  importlib.import_module(f"{name}.user")   # the shared package holds kernels
  user = import_swapped(f"{name}.user", include=(f"{name}.lib.kernels",))
  assert swap_report(user.eager, X).ok
  assert swap_report(user.lazy, X).ok
  shared = importlib.import_module(f"{name}.user")
  assert not swap_report(shared.eager, X).ok
  assert_bitwise(checkpointed_grad(user.lazy)(X),
                 checkpointed_grad(shared.lazy)(X))


def test_a_copy_that_would_change_nothing_is_a_swap_error(library):
  """``import_swapped("aqt")`` copied a package whose ``__init__`` imports
  none of its submodules: the error names them and the way that works."""
  name = library({"__init__.py": "", "kernels.py": LIBRARY})
  importlib.import_module(f"{name}.kernels")
  with pytest.raises(SwapError, match="no custom_vjp function") as e:
    import_swapped(name)
  assert f"{name}.kernels" in str(e.value)
  assert "swap_custom_vjp(existing=True)" in str(e.value)
  copy = import_swapped(f"{name}.kernels", include=(name,))   # the advice
  assert swap_report(copy).ok


def test_a_module_that_re_exports_from_outside_the_copy_names_both_fixes(
    library):
  """Issue 58: ``import_swapped("jaxopt.implicit_diff")``, a module that
  re-exports ``custom_root`` from ``jaxopt._src.implicit_diff``: the error
  says so and names both ways that work, each of which then gives the
  swapped rules (bitwise equal gradients)."""
  name = f"swaplib_{uuid.uuid4().hex[:10]}"
  library({
      "__init__.py": f"from {name} import implicit_diff\n",
      "_src/__init__.py": "",
      "_src/implicit_diff.py": """
          import jax
          import jax.numpy as jnp

          def custom_root(scale):
            @jax.custom_vjp
            def solve(x):
              return jnp.sin(x) * scale
            solve.defvjp(lambda x: (jnp.sin(x) * scale, jnp.cos(x)),
                         lambda c, g: (c * g * scale,))
            return solve
          """,
      "implicit_diff.py": f"from {name}._src.implicit_diff import custom_root\n",
  }, name)
  importlib.import_module(f"{name}.implicit_diff")
  with pytest.raises(SwapError, match="re-exports custom_root from") as e:
    import_swapped(f"{name}.implicit_diff")
  message = str(e.value)
  assert f"{name}._src.implicit_diff" in message
  assert f"import_swapped({name!r})" in message
  assert (f"import_swapped('{name}.implicit_diff', "
          f"include=('{name}._src.implicit_diff',))") in message
  shared = importlib.import_module(f"{name}.implicit_diff").custom_root(2.0)
  want = checkpointed_grad(shared)(X)
  for copy in (import_swapped(name).implicit_diff,
               import_swapped(f"{name}.implicit_diff",
                              include=(f"{name}._src.implicit_diff",))):
    solve = copy.custom_root(2.0)
    assert swap_report(solve, X).ok
    assert_bitwise(checkpointed_grad(solve)(X), want)


def test_existing_names_what_it_leaves_and_a_cached_trace(library):
  name = library(LIBRARY)
  lib = importlib.import_module(name)
  grad_clip = jax.custom_gradient(
      lambda x: (x, lambda g: (jnp.clip(g, -1, 1),)))
  cached = jax.jit(lambda x: lib.attribute(x) * 2.0)
  cached(X)   # traced and cached before the block
  want = jax.grad(lambda x: jnp.sum(jax.checkpoint(cached)(x)))(X)
  with swap_custom_vjp(existing=True):
    # the block cleared JAX's caches on entry: the jax.jit traced before it
    # (tensorcircuit's adaware_svd_jit) is traced again, with smartvjp's rules
    report = swap_report(lambda x: grad_clip(x) + cached(x), X)
    program = str(jax.make_jaxpr(jax.grad(
        lambda x: jnp.sum(jax.checkpoint(cached)(x))))(X))
    got = jax.grad(lambda x: jnp.sum(jax.checkpoint(cached)(x)))(X)
  inside_jax = [k for k in report if k.startswith("jax._src.")]
  assert report == {f"{name}.attribute": True, **dict.fromkeys(inside_jax,
                                                               False)}, report
  assert len(inside_jax) == 1   # its name differs between JAX releases
  assert "jax.custom_gradient" in report.why[inside_jax[0]]
  assert "smartvjp_" in program and "custom_vjp_call" not in program
  np.testing.assert_array_equal(bits(got), bits(want))


def test_a_batched_call_is_reported_under_the_users_name(library):
  name = library(LIBRARY)
  copy = import_swapped(name)
  report = swap_report(jax.vmap(copy.attribute), jnp.ones((3, 7)))
  assert report == {f"{name}.attribute": True}, report
  with swap_custom_vjp(existing=True):
    lib = importlib.import_module(name)
    report = swap_report(
        lambda x: jnp.vectorize(lib.attribute, signature="(n)->(n)")(x),
        jnp.ones((3, 7)))
  assert report == {f"{name}.attribute": True}, report


def test_a_checkpoint_trace_cached_in_the_block_outlives_it_until_caches_clear():
  # documented (design/limitations.md, swap_custom_vjp's docstring): JAX
  # caches jax.checkpoint's trace by the function, so a program traced after
  # the block that checkpoints the same library function reuses the trace
  # made inside; jax.clear_caches() ends that
  lib_fn = jax.custom_vjp(lambda x: jnp.sin(x))
  lib_fn.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  x = jnp.arange(3.0)

  def smart():
    return "smartvjp_" in str(jax.make_jaxpr(jax.grad(
        lambda x: jnp.sum(jax.checkpoint(lib_fn)(x))))(x))
  assert not smart()
  jax.clear_caches()
  with swap_custom_vjp(existing=True):
    assert smart()
  assert smart()   # the trace made inside, reused
  jax.clear_caches()
  assert not smart()


# -- libraries that configure themselves (issue 48: tensorcircuit-ng) ------------------

# tensorcircuit's set_backend, distilled: it sets an attribute on each of its
# modules that it finds in sys.modules by name, and its ops read it when
# they run; a backend module is imported by name (importlib.import_module)
CONFIGURING = {
    "__init__.py": """
        from .cons import set_backend, backend_name
        from . import ops
    """,
    "cons.py": """
        import importlib, sys
        backend = "numpy"
        def set_backend(name):
          for module in list(sys.modules):
            if module.startswith(__name__.rpartition(".")[0]):
              setattr(sys.modules[module], "backend", name)
        def backend_name():
          return importlib.import_module(__name__).backend
    """,
    "ops.py": """
        import jax, jax.numpy as jnp
        backend = "numpy"
        @jax.custom_vjp
        def square(x):
          if backend != "jax":
            raise TypeError(f"backend is {backend}: cannot take a traced value")
          return x * x
        square.defvjp(lambda x: (x * x, x), lambda x, g: (2 * x * g,))
    """,
}


def test_import_swapped_copy_finds_its_own_modules(library):
  name = library(CONFIGURING)
  shared = importlib.import_module(name)
  copy = import_swapped(name)
  copy.set_backend("jax")
  # the copy's modules were found by name; the library as imported is not
  assert copy.ops.backend == copy.cons.backend == "jax"
  assert copy.backend_name() == "jax"
  assert shared.ops.backend == shared.cons.backend == "numpy"
  assert shared.backend_name() == "numpy"
  assert sys.modules[f"{name}.ops"] is shared.ops
  loss = lambda x: jnp.sum(jax.checkpoint(copy.ops.square)(x))
  assert swap_report(copy.ops.square, X).ok
  shared.set_backend("jax")
  assert copy.ops.backend == "jax" and shared.ops.backend == "jax"
  assert_bitwise(jax.jit(jax.grad(loss))(X), jax.jit(jax.grad(
      lambda x: jnp.sum(jax.checkpoint(shared.ops.square)(x))))(X))


# a package that, when imported, patches a class of a library it shares
PATCHING = {
    "__init__.py": """
        import jax
        import fractions
        def _twice(self):
          return 2
        fractions.Fraction.twice = _twice
        @jax.custom_vjp
        def f(x):
          return x
        f.defvjp(lambda x: (x, None), lambda r, g: (g,))
    """,
}


def test_import_swapped_warns_where_the_copy_patches_a_shared_library(library):
  import fractions
  name = library(PATCHING)
  with pytest.warns(UserWarning, match=r"replaced fractions\.Fraction\.twice"):
    copy = import_swapped(name)
  assert fractions.Fraction.twice.__globals__ is vars(copy)
  del fractions.Fraction.twice


def test_import_swapped_of_a_package_that_patches_nothing_does_not_warn(library):
  import warnings
  name = library(CONFIGURING)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    import_swapped(name)


# a package that imports a submodule inside a function, the first time it runs
LAZY = {
    "__init__.py": """
        def solve(x):
          from .kernels import square
          return square(x)
    """,
    "kernels.py": """
        import jax
        @jax.custom_vjp
        def square(x):
          return x * x
        square.defvjp(lambda x: (x * x, x), lambda x, g: (2 * x * g,))
    """,
}


def test_swap_custom_vjp_reaches_submodules_imported_after_the_block(library):
  name = library(LAZY)
  with swap_custom_vjp():
    lib = importlib.import_module(name)
  assert f"{name}.kernels" not in sys.modules
  report = swap_report(lib.solve, X)   # imports kernels, after the block
  assert report == {f"{name}.kernels.square": True}, report
  assert isinstance(sys.modules[f"{name}.kernels"].square,
                    smartvjp.smart_custom_vjp)
  assert jax.custom_vjp is not smartvjp.smart_custom_vjp
  # a package first imported outside any block is not reached
  other = library(LAZY)
  report = swap_report(importlib.import_module(other).solve, X)
  assert report == {f"{other}.kernels.square": False}, report
