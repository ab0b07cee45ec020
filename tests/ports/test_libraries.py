"""Issue 34's (and issue 56's) libraries that install cheaply, swapped by their one call.

``tools/try_libraries.py`` runs each program twice, each side in a fresh
process: the library as installed (``jax.custom_vjp``), and the same
programs traced inside ``smartvjp.swap_custom_vjp(existing=True)`` (the
one call, after an ordinary import). Here: jax-cce (a fused linear
cross-entropy kernel: a ``lax.scan`` over vocabulary chunks in ``f``,
``fwd`` and ``bwd``) and optimistix (solvers whose
``RecursiveCheckpointAdjoint`` is an ``equinox.filter_custom_vjp``: the
``custom_vjp`` is made by equinox when the solve runs). Each case must give
the same values bit for bit, and ``swap_report`` must agree with the jaxpr
on both sides (smartvjp's equations and no ``custom_vjp_call`` exactly
where it says ``ok``). The other five libraries (ejkernel, qwix, aqtp,
jax-md, TensorFlow Probability) are run by the tool itself: their installs
are too large for CI (design/conformance.md has every result).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def _tool():
  spec = importlib.util.spec_from_file_location(
      "try_libraries", os.path.join(ROOT, "tools", "try_libraries.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# the cases run here (names from the tool); more_work: the cases where
# smartvjp's program has more flops than jax.custom_vjp's, each a known
# difference with its reason (design/conformance.md)
CASES = {
    "jax_cce": {
        "loss": None, "loss eager": None, "filter_eps": None,
        "vmap(grad)": None, "grad(vmap)": None,
        "loss checkpoint": (
            "XLA fuses the masked select of f's loop into two consumers "
            "(1024 flops more, one 32x32 select): JAX's partial evaluation "
            "of the inlined fwd hoists the loop's invariant broadcasts, "
            "smartvjp's traced fwd keeps them in the loop")},
    "optimistix": {
        "root_find Newton grad": None, "root_find Newton vmap(grad)": None,
        "root_find Newton grad(vmap)": None, "fixed_point grad": None},
    # issue 48's libraries that install quickly
    "qpax": {
        "solve checkpoint": None,
        "scan": (
            "XLA fuses the scanned solve's elementwise work differently (10 "
            "flops more in 2020, fewer fusions; the same matrix products and "
            "factorizations): JAX's partial evaluation of the inlined fwd "
            "in the scan body, smartvjp's traced fwd whole")},
    "recurrentgemma": {"RGLRU checkpoint": None},
    "tensorcircuit": {"MPSCircuit svd checkpoint": None},
    # issue 56's libraries that install quickly: jax-fdm's implicit
    # fixed-point solver, agjax's autograd wrapper (a host callback) and
    # fmmax's eig, plain, checkpointed and (jax-fdm) scanned
    "jax_fdm": {"fixed_point grad": None, "fixed_point checkpoint": None,
                "fixed_point scan": None},
    "agjax": {"wrapped grad": None, "wrapped checkpoint": None},
    "fmmax": {"eig grad": None, "eig checkpoint": None},
}


@pytest.mark.parametrize("library", sorted(CASES))
def test_library_swapped_by_one_call(library, tmp_path):
  """One test per library, so that each runs once under pytest-xdist."""
  pytest.importorskip(library)
  result = _tool().compare(library, str(tmp_path), tuple(CASES[library]))
  assert "failed" not in result and "skipped" not in result, result
  assert set(result["cases"]) == set(CASES[library])
  problems = []
  for case, verdict in result["cases"].items():
    theirs, ours = verdict["flops"]
    more = ours > theirs
    if verdict["value"] != "equal":
      problems.append(f"{case}: values {verdict['value']}")
    if verdict["report"] != "agrees: all smartvjp":
      problems.append(f"{case}: swap_report {verdict['report']}")
    if verdict["dots"][1] > verdict["dots"][0]:
      problems.append(f"{case}: matrix products {verdict['dots']}")
    # a known difference must still be there (like a strict xfail): when
    # the core change lands, the case leaves the list
    if more != bool(CASES[library][case]):
      problems.append(f"{case}: flops {theirs:g} (jax.custom_vjp) -> "
                      f"{ours:g}" + (" (known: remove it from CASES)"
                                     if not more else ""))
  assert not problems, "\n".join(problems)



def test_qpax_runs_f_in_the_forward_pass_under_checkpoint():
  # issue 48: qpax passes its inputs through jnp.atleast_2d before its
  # solves' while_loops read them; under jax.checkpoint the forward pass
  # runs f (the solve) and the backward region fwd (solve + relaxed
  # re-solve), the contract's "f 1, fwd 1, bwd 1"; the values are
  # jax.custom_vjp's, bit for bit
  qpax = pytest.importorskip("qpax")
  import jax
  import jax.numpy as jnp
  import numpy as np
  import smartvjp
  swapped = smartvjp.import_swapped("qpax")
  Q = jnp.array([[2.0, 0.5, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 1.0]])
  A, b = jnp.ones((1, 3)), jnp.ones((1,))
  G, h = -jnp.eye(3), jnp.zeros(3)
  q = jnp.array([1.0, -1.0, 0.5])

  def grad(module):
    return jax.grad(lambda q: jnp.sum(jax.checkpoint(
        module.solve_qp_primal)(Q, q, A, b, G, h) ** 2))
  program = str(jax.make_jaxpr(grad(swapped))(q))
  forward, _, backward = program.partition("remat")
  assert "smartvjp_primal" in forward and "smartvjp_fwd" not in forward
  assert "smartvjp_fwd" in backward and "smartvjp_bwd" in backward
  np.testing.assert_array_equal(jax.jit(grad(swapped))(q),
                                jax.jit(grad(qpax))(q))
