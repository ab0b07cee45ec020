"""The compatibility layer: a JAX without an internal smartvjp needs fails at
import with one clear error, and the registration adapters match the
installed JAX's calling conventions."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from smartvjp import _compat, smart_custom_vjp

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def test_missing_internal_is_named_with_the_jax_version():
  with pytest.raises(ImportError) as info:
    _compat.check_internals(
        (("jax._src.core", ("typeof", "no_such_internal")),
         ("jax._src.no_such_module", ("x",))))
  msg = str(info.value)
  assert f"jax {jax.__version__}" in msg
  assert "jax._src.core.no_such_internal" in msg
  assert "jax._src.no_such_module" in msg
  assert "jax._src.core.typeof" not in msg


def test_import_fails_early_when_jax_lacks_an_internal():
  # simulate a JAX release that removed one internal smartvjp relies on
  code = ("import jax._src.core as core\n"
          "del core.typecompat\n"
          "import smartvjp\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("ImportError: smartvjp does not support")
  assert "jax._src.core.typecompat" in last and jax.__version__ in last


def test_no_other_module_reaches_into_jax_internals():
  pkg = os.path.join(ROOT, "smartvjp")
  for name in sorted(os.listdir(pkg)):
    if not name.endswith(".py") or name == "_compat.py":
      continue
    with open(os.path.join(pkg, name)) as fh:
      text = fh.read()
    for needle in ("jax._src", "jax.extend", "jax.interpreters",
                   "C.core.", "C.pe.", "C.ad.", "C.batching.", "C.mlir."):
      assert needle not in text.replace("``jax/_src/", ""), (name, needle)


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
