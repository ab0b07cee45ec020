"""Issue 34's libraries that install cheaply, swapped by their one call.

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
