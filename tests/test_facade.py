"""The facade over JAX's internals (``smartvjp/_facade.py``).

* A JAX without an internal smartvjp needs fails at import with one error
  naming it and the installed version.
* Its declared internals are exactly the ones it uses: a declared name no
  code uses fails here, and so does one used without being declared (which
  would also be an ``AttributeError`` when that code runs).
* No other module reaches into JAX's internals.
* The registration adapters follow the installed JAX's conventions.
"""

import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

from smartvjp import _facade, smart_custom_vjp

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "smartvjp"
FACADE = (PKG / "_facade.py").read_text()


def _run(code):
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)


def test_import_fails_early_naming_a_missing_internal():
  # a JAX release that removed one internal smartvjp relies on
  proc = _run("import jax._src.core as core\n"
              "del core.typecompat\n"
              "import smartvjp\n")
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("ImportError: smartvjp does not support")
  assert "jax._src.core.typecompat" in last and jax.__version__ in last


def test_import_fails_early_naming_a_missing_module():
  proc = _run("import sys\n"
              "sys.modules['jax._src.interpreters.remat'] = None\n"
              "import smartvjp\n")
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert "jax._src.interpreters.remat" in last


def _uses(alias_names):
  """``(alias, name)`` of every use of a declared namespace: ``alias.name``
  in ``_facade.py``, ``jx.alias.name`` in the other modules."""
  used = set()
  for path in sorted(PKG.rglob("*.py")):
    prefix = r"\b" if path.name == "_facade.py" else r"\bjx\."
    for alias, name in re.findall(rf"{prefix}([a-z_]+)\.([A-Za-z_]\w*)",
                                  path.read_text()):
      if alias in alias_names:
        used.add((alias, name))
  return used


def test_every_declared_internal_is_used():
  used = _uses({alias for alias, _, _ in _facade.REQUIRED})
  unused = [f"{module}.{name}" for alias, module, names in _facade.REQUIRED
            for name in names if (alias, name) not in used]
  assert not unused, f"declared in _facade.py but never used: {unused}"


def test_every_used_internal_is_declared():
  declared = {alias: set(names) for alias, _, names in _facade.REQUIRED}
  undeclared = sorted(f"{alias}.{name}" for alias, name in _uses(declared)
                      if name not in declared[alias])
  assert not undeclared, f"used but not declared in _facade.py: {undeclared}"


def test_namespaces_hold_only_declared_names():
  # JAX's modules are exported as namespaces of the declared names alone
  assert isinstance(_facade.core.Primitive, type)
  try:
    _facade.core.Jaxpr_not_declared  # noqa: B018
  except AttributeError:
    pass
  else:
    raise AssertionError("an undeclared name is reachable")


def test_no_other_module_reaches_into_jax_internals():
  for path in sorted(PKG.rglob("*.py")):
    if path.name == "_facade.py":
      continue
    text = path.read_text()
    for needle in ("jax._src", "jax.extend", "jax.interpreters",
                   "from jax import core", "jax.core."):
      assert needle not in text.replace("``jax/_src/", ""), (path.name,
                                                             needle)


def test_adapters_follow_the_installed_conventions():
  # grad without remat goes through the linearization adapter, jit+DCE
  # through the DCE adapter: both must work on this JAX
  f = smart_custom_vjp(jnp.sin)
  f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  g = jax.jit(jax.grad(lambda x: f(x) * 2.0))(0.5)
  assert jnp.allclose(g, 2.0 * jnp.cos(0.5))
  # JAX's DCE calls our rule with the installed signature (0.12 added
  # live_ins): an unused call is dropped, a used one kept
  from jax._src.interpreters import partial_eval as pe  # test-only internal
  jaxpr = jax.make_jaxpr(lambda x: (f(x), x))(1.0).jaxpr
  pruned, _ = pe.dce_jaxpr(jaxpr, [False, True])
  assert not pruned.eqns
  kept, _ = pe.dce_jaxpr(jaxpr, [True, False])
  assert [e.primitive.name for e in kept.eqns] == ["smartvjp_call"]
