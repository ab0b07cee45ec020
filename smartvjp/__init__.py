"""smartvjp: ``jax.custom_vjp`` rules that do not run ``fwd`` twice under remat.

Under ``jax.checkpoint``, ``jax.custom_vjp`` runs ``fwd`` in the forward pass,
drops its residuals and runs ``fwd`` again in the backward pass
(jax-ml/jax#21303). ``smart_custom_vjp`` takes the same rules and runs ``f`` in
the forward pass and ``fwd`` (or a fused ``fwd_bwd``) only in the backward
pass.

Public names:

* ``smart_custom_vjp``: replaces ``jax.custom_vjp`` (same ``defvjp``, plus an
  optional ``fwd_bwd=`` rule). ``help(smartvjp.smart_custom_vjp)`` has a
  runnable example and the ways it differs from ``jax.custom_vjp``.
* ``filter_custom_vjp``: replaces ``equinox.filter_custom_vjp``.
* ``check_primals``, ``PrimalMismatchError``: an opt-in check that ``f`` and
  ``fwd`` agree.
* ``import_swapped``, ``swap_custom_vjp``, ``SwapError``:
  ``smart_custom_vjp`` in code you do not own (a library's module-level
  ``@jax.custom_vjp``, JAX's shipped Pallas kernels); ``swap_report``,
  ``SwapReport``: whether a program's custom rules are smartvjp's.
* ``NotTransposableError``: the ``TypeError`` forward mode raises where a
  rule cannot be transposed or traced and no forward rule is given.
* ``print_schedule``, ``ScheduledRule``: which rule each smartvjp equation
  of a program runs, and where.
* ``__version__``: this version of smartvjp, a string (PEP 440).
"""

from smartvjp._api import smart_custom_vjp
# each transformation's module registers its rules when imported
from smartvjp import _ad, _batching, _checkify, _process, _remat  # noqa: F401
from smartvjp._check import PrimalMismatchError, check_primals
from smartvjp._equinox import filter_custom_vjp
from smartvjp._swap import SwapError, import_swapped, swap_custom_vjp
from smartvjp._swap import SwapReport, swap_report
from smartvjp._schedule import ScheduledRule, print_schedule
from smartvjp._forward import NotTransposableError
from smartvjp import audit

# The one place the version is written: pyproject.toml reads it from here
# (setuptools' dynamic version, without importing the package), and
# CHANGELOG.md has a section for it (tests/test_release.py checks both).
__version__ = "0.2.0.dev0"

__all__ = ["smart_custom_vjp", "filter_custom_vjp", "check_primals",
           "PrimalMismatchError", "import_swapped", "swap_custom_vjp",
           "swap_report", "SwapReport", "SwapError", "print_schedule",
           "ScheduledRule", "NotTransposableError", "audit", "__version__"]
