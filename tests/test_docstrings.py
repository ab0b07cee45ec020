"""``help()`` says only what a test checks.

Every public docstring that the API reference shows (``docs/api.md``) is
tied to tests: each entry of its ``Raises:`` section, and each bullet of its
lists, has at least one ``Claim`` below, which quotes the docstring (so a
changed docstring needs its claims looked at again) and names the test that
checks it, in this file or in the file that owns the feature. The tests
here check the claims no other file checks directly; they run on every
supported JAX version (a claim about a method JAX lacks skips there).

The docstrings' examples run in ``tests/test_readme_and_help.py`` (the
three long ones) and ``test_every_docstring_example_runs`` below.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import importlib
import inspect
import os
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
import smartvjp
from smartvjp import smart_custom_vjp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
HERE = os.path.basename(__file__)


# -- the documented objects and what their docstrings say ----------------------------

def documented() -> dict[str, object]:
  """``{"name" or "name.member": object}``, as docs/api.md shows them."""
  text = open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8").read()
  out = {}
  for name, rest in re.findall(r"^::: smartvjp\.([\w.]+)\n((?:    .*\n)*)",
                               text, re.M):
    if name == "tesseract":
      continue   # imports tesseract_core, which the test extra lacks
    obj = importlib.import_module("smartvjp." + name.rpartition(".")[0]) \
        if "." in name else smartvjp
    obj = getattr(obj, name.rpartition(".")[2])
    out[name] = obj
    for member in re.findall(r"- (\w+)", rest):
      out[f"{name}.{member}"] = getattr(obj, member)
  return out


DOCUMENTED = documented()


def norm(text: str) -> str:
  return " ".join(text.replace("`", "").split())


def doc(name: str) -> str:
  return inspect.getdoc(DOCUMENTED[name]) or ""


def raises_entries(name: str) -> dict[str, str]:
  """``{exception name: its text}`` from the docstring's ``Raises:``."""
  lines = doc(name).splitlines()
  if "Raises:" not in [l.strip() for l in lines]:
    return {}
  start = [l.strip() for l in lines].index("Raises:") + 1
  body = []
  for line in lines[start:]:
    if line.strip() and not line.startswith(" "):
      break
    body.append(line)
  indent = min(len(l) - len(l.lstrip()) for l in body if l.strip())
  entries, current = {}, None
  for line in body:
    m = re.match(rf"^ {{{indent}}}([\w.]+):\s*(.*)$", line)
    if m:
      current = m.group(1)
      entries[current] = m.group(2)
    elif current and line.strip():
      entries[current] += " " + line.strip()
  return {k: norm(v) for k, v in entries.items()}


def bullets(name: str) -> list[str]:
  """The items of the docstring's ``*`` lists (outside code blocks)."""
  out, current, indent, fenced = [], None, 0, False
  for line in doc(name).splitlines():
    if line.strip().startswith("```"):
      fenced = not fenced
    m = re.match(r"^(\s*)\* (.*)$", line)
    if fenced:
      continue
    if m:
      if current is not None:
        out.append(current)
      current, indent = m.group(2), len(m.group(1)) + 2
    elif current is not None and line.strip() and \
        len(line) - len(line.lstrip()) >= indent:
      current += " " + line.strip()
    elif current is not None:
      out.append(current)
      current = None
  if current is not None:
    out.append(current)
  return [norm(b) for b in out]


# -- the claims ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Claim:
  obj: str        # a key of DOCUMENTED
  quote: str      # words of the docstring (backticks and line breaks ignored)
  by: str         # a test: a function of this file, or "tests/FILE.py::name"
  raises: str | None = None   # the Raises entry the quote is from


C = Claim
SCV = "smart_custom_vjp"
FCV = "filter_custom_vjp"
AU = "tests/test_audit.py::"
CLAIMS = [
    # smartvjp.audit
    C("audit", "as_written: each site as jax.custom_vjp with its rules",
      AU + "test_contract_row"),
    C("audit", "optimize_remat: each as jax.custom_vjp with optimize_remat=True",
      AU + "test_contract_row"),
    C("audit", "smartvjp: each as smart_custom_vjp with fwd and bwd",
      AU + "test_contract_row"),
    C("audit", "smartvjp_fused: each as smart_custom_vjp with its fwd_bwd",
      AU + "test_contract_row_fwd_bwd"),
    C("audit.audit", "fn does not trace or compile under any configuration",
      AU + "test_untraceable_function_is_a_clear_error", raises="AuditError"),
    C("audit.audit", "makes no jax.custom_vjp or smart_custom_vjp call",
      AU + "test_no_custom_vjp_is_a_clear_error", raises="AuditError"),
    C("audit.audit", "donates arguments",
      AU + "test_donated_arguments_are_a_clear_error", raises="AuditError"),
    C("audit.audit", "does not start with \"as_written\"",
      "tests/test_audit_trial.py::test_argument_checks", raises="ValueError"),
    C("audit.audit", "measure or calibrate is not a bool",
      "tests/test_audit_trial.py::test_argument_checks", raises="TypeError"),
    C("audit.audit", "an argument is a string (bind it with functools.partial",
      "tests/test_audit_trial.py::test_argument_checks", raises="TypeError"),
    C("audit.audit", "checks both estimates against the step's measured saving",
      "tests/test_audit_trial.py::test_verdict_against_the_measurements_"
      "interval"),
    C("audit.audit", "timing_budget is not a number of seconds >= 0",
      "tests/test_audit_timing.py::test_the_budget_is_honoured_and_recorded",
      raises="ValueError"),
    C("audit.audit", "configs names an unknown configuration",
      AU + "test_unknown_configuration_is_a_clear_error", raises="ValueError"),
    C("audit.audit", "peaks has a key other than flops, bytes, launch",
      "tests/test_audit_model.py::test_peaks_argument_and_callback_note",
      raises="ValueError"),
    C("audit.assert_no_duplicate_fwd", "naming each offending site",
      AU + "test_assert_no_duplicate_fwd", raises="AssertionError"),
    C("audit.assert_no_duplicate_fwd", "as audit",
      AU + "test_assert_no_duplicate_fwd", raises="AuditError"),
    # smart_custom_vjp: what runs where
    C(SCV, "Evaluation, under jit or not: f only; fwd and bwd are not traced",
      "test_evaluation_runs_f_only"),
    C(SCV, "jax.grad/jax.vjp without remat: fwd, then bwd in the backward pass",
      "tests/test_contract.py::test_grad_without_remat"),
    C(SCV, "f is not traced, as with jax.custom_vjp: Python code in f that "
      "needs concrete values (if x > 0:) works under eager jax.grad",
      "test_direct_grad_does_not_trace_f"),
    C(SCV, "f in the forward pass; fwd then bwd (or fwd_bwd, if given) in the "
      "rematerialized backward region",
      "tests/test_contract.py::test_grad_with_checkpoint"),
    C(SCV, "(or fwd_bwd, if given)",
      "tests/test_contract.py::test_checkpoint_with_fwd_bwd"),
    C(SCV, "a fwd whose residuals are all inputs runs in neither pass (f "
      "forward, bwd backward; fwd is traced, to find that out)",
      "tests/test_contract.py::test_seed_fwd_residual_is_input"),
    C(SCV, "fwd in the forward pass, only bwd in the backward pass; f does "
      "not run", "tests/test_contract.py::test_everything_saveable"),
    C(SCV, "save_only_these_names naming every residual",
      "tests/test_contract.py::test_named_residual_saved_by_policy"),
    C(SCV, "A policy that saves some of what a JAX-coded fwd computes splits "
      "fwd", "test_partial_policy_splits_a_jax_coded_fwd"),
    C(SCV, "A fwd whose work is one opaque kernel (a Pallas call, a custom "
      "call, a callback) cannot be split and is recomputed whole",
      "test_partial_policy_recomputes_an_opaque_fwd_whole"),
    C(SCV, "finds the split no cheaper",
      "tests/test_plan.py::test_plan_table"),
    C(SCV, "no kernel runs more often than with jax.custom_vjp",
      "test_partial_policy_recomputes_an_opaque_fwd_whole"),
    C(SCV, "f runs (is traced) where it runs with jax.custom_vjp",
      "tests/test_rule_runs.py::test_rule_bodies_run_as_with_custom_vjp"),
    C(SCV, "a dot_general output is saveable under dots_saveable; a kernel's "
      "output is not",
      "tests/test_contract.py::test_policy_asks_about_the_equation_producing_each_residual"),
    # smart_custom_vjp: where it differs
    C(SCV, "the forward value is f's, where jax.custom_vjp's is fwd's",
      "test_forward_value_is_fs_where_f_stands_in_for_fwd"),
    C(SCV, "smartvjp.check_primals checks it under remat",
      "tests/test_check_primals.py::test_raise_names_both_rules"),
    C(SCV, "each rule is traced once per signature",
      "test_rules_traced_once_per_signature_and_program"),
    C(SCV, "each new program traces the rules again",
      "test_rules_traced_once_per_signature_and_program"),
    C(SCV, "Eager jax.grad/jax.vjp run fwd and bwd on concrete values at each "
      "call", "test_rules_traced_once_per_signature_and_program"),
    C(SCV, "Differentiating only values that f closes over (none of its "
      "arguments) differentiates f itself",
      "tests/test_tracing.py::test_derivative_only_through_a_closure_differentiates_f"),
    C(SCV, "optimize_remat is accepted and ignored",
      "test_optimize_remat_changes_nothing"),
    C(SCV, "forward mode (jax.jvp, jax.jacfwd, jax.linearize) transposes",
      "tests/test_forward_mode.py::test_jvp_jacfwd_linearize"),
    C(SCV, "an opaque bwd raises TypeError",
      "tests/test_forward_mode.py::test_opaque_bwd_forward_mode_error"),
    C(SCV, "higher-order derivatives under remat differentiate the rules "
      "themselves", "tests/test_higher_order.py::test_grad_of_grad"),
    C(SCV, "integer inputs get float0 cotangents",
      "tests/test_api.py::test_integer_input_and_output"),
    C(SCV, "hashable or not; never tracers", "test_nondiff_values_hashable_or_not"),
    C(SCV, "a name that is not a parameter of fun is ignored, as "
      "jax.custom_vjp ignores it", "tests/test_errors.py::test_unknown_nondiff_argname"),
    # defvjp
    C(f"{SCV}.defvjp", "unless fwd and bwd, or fwd_bwd, or all three are given",
      "tests/test_api.py::test_defvjp_needs_a_pair_or_fused", raises="TypeError"),
    C(f"{SCV}.defvjp", "when a given rule is not callable",
      "test_defvjp_type_errors", raises="TypeError"),
    C(f"{SCV}.defvjp", "when symbolic_zeros or generic_batching is not a bool",
      "test_defvjp_type_errors", raises="TypeError"),
    C(f"{SCV}.defvjp", "generic_batching given where the installed "
      "jax.custom_vjp.defvjp has no such parameter",
      "tests/test_api_parity.py::test_generic_batching_missing_raises",
      raises="NotImplementedError"),
    C(f"{SCV}.defvjp", "fwd and fwd_bwd receive "
      "jax.custom_derivatives.CustomVJPPrimal leaves",
      "test_symbolic_zeros_reach_fwd_bwd"),
    C(f"{SCV}.defvjp", "and everywhere when fwd and bwd are not given",
      "tests/test_contract.py::test_only_fwd_bwd"),
    # __call__
    C(f"{SCV}.__call__", "when defvjp (or another definition method) has not "
      "been called yet", "tests/test_api.py::test_call_before_defvjp",
      raises="AttributeError"),
    C(f"{SCV}.__call__", "when the arguments do not fit f's signature "
      "(keyword-only parameters included)",
      "tests/test_errors.py::test_keyword_only_arguments_are_refused_clearly",
      raises="TypeError"),
    C(f"{SCV}.__call__", "when a differentiable argument holds a value that is "
      "not a JAX type", "tests/test_errors.py::test_non_array_argument",
      raises="TypeError"),
    C(f"{SCV}.__call__", "fwd not an (out, residuals) pair",
      "tests/test_errors.py::test_fwd_not_a_pair", raises="TypeError"),
    C(f"{SCV}.__call__", "residuals that are not JAX types",
      "tests/test_errors.py::test_residuals_not_jax_types", raises="TypeError"),
    C(f"{SCV}.__call__", "bwd or fwd_bwd not a tuple with one cotangent per "
      "differentiable argument",
      "tests/test_errors.py::test_bwd_wrong_length_or_cotangent_for_nondiff_arg",
      raises="TypeError"),
    C(f"{SCV}.__call__", "bwd or fwd_bwd not a tuple",
      "tests/test_errors.py::test_fwd_bwd_wrong_output", raises="TypeError"),
    C(f"{SCV}.__call__", "a cotangent of the wrong pytree structure",
      "tests/test_errors.py::test_bwd_wrong_structure", raises="TypeError"),
    C(f"{SCV}.__call__", "when fwd's primal output differs from f's in "
      "structure, shape or dtype where both are traced",
      "tests/test_errors.py::test_fwd_primal_shape_or_dtype_differs",
      raises="TypeError"),
    C(f"{SCV}.__call__", "as jax.custom_vjp, which checks only there",
      "test_fwd_primal_output_unchecked_where_f_is_not_traced",
      raises="TypeError"),
    C(f"{SCV}.__call__", "when bwd (or fwd_bwd) cannot be transposed in its "
      "cotangent", "tests/test_forward_mode.py::test_opaque_bwd_forward_mode_error",
      raises="smartvjp.NotTransposableError"),
    C(f"{SCV}.__call__", "or when f or fwd cannot be traced",
      "tests/test_forward_mode.py::"
      "test_untraceable_f_or_fwd_in_forward_mode_is_our_type_error",
      raises="smartvjp.NotTransposableError"),
    C(f"{SCV}.__call__", "it is also of that type",
      "tests/test_forward_mode.py::test_forward_mode_error_is_the_exported_class",
      raises="smartvjp.NotTransposableError"),
    C(f"{SCV}.__call__", "when bwd (or fwd_bwd) returns a cotangent whose shape "
      "differs from its argument's",
      "tests/test_errors.py::test_bwd_wrong_shape_or_dtype", raises="ValueError"),
    C(f"{SCV}.__call__", "one mutable array reference is passed through two "
      "differentiable arguments",
      "tests/test_refs.py::test_the_same_reference_twice_is_an_error_when_differentiated",
      raises="ValueError"),
    C(f"{SCV}.__call__", "when f or fwd returns a reference",
      "tests/test_refs.py::test_fwd_returning_a_new_reference_is_an_error",
      raises="ValueError"),
    C(f"{SCV}.__call__", "when f or fwd returns a reference",
      "test_f_returning_a_reference_is_a_value_error", raises="ValueError"),
    C(f"{SCV}.__call__", "when a tracer is passed at a nondiff position",
      "tests/test_api.py::test_tracer_in_nondiff_position",
      raises="jax.errors.UnexpectedTracerError"),
    C(f"{SCV}.__call__", "where jax.grad, jax.vjp or jax.jvp apply directly to "
      "the call, through vmaps too",
      "tests/test_tracing.py::test_closed_over_value_and_arguments_moved_together_is_an_error",
      raises="jax.errors.UnexpectedTracerError"),
    C(f"{SCV}.__call__", "in a staged call (jit(F), a scan or cond body, "
      "jax.checkpoint)",
      "tests/test_tracing.py::test_closed_over_value_and_arguments_moved_together_is_an_error",
      raises="CustomVJPException"),
    C(f"{SCV}.__call__", "the type jax.custom_vjp raises there, a private class "
      "of JAX's", "test_closure_errors_are_jaxs_types",
      raises="CustomVJPException"),
    C(f"{SCV}.__call__", "With no transformation active f is simply called",
      "test_evaluation_runs_f_only"),
    C(f"{SCV}.__call__", "one that carries the traced fwd and no trace of f",
      "tests/test_rule_runs.py::test_f_is_not_traced_where_only_fwd_runs"),
    # the newer methods
    C(f"{SCV}.defvjp_with_logs", "when the installed jax.custom_vjp has no such "
      "method (before jax 0.11.2)",
      "tests/test_api_parity.py::test_missing_method_raises",
      raises="NotImplementedError"),
    C(f"{SCV}.defvjp_with_logs", "through jit, scan, vmap, checkpoint",
      "tests/test_api_parity.py::test_with_logs_entries_match_jax"),
    C(f"{SCV}.defvjp_with_logs", "returns no pair, or logs that are neither "
      "None nor a dict, raises TypeError when it runs",
      "tests/test_api_parity.py::test_with_logs_bad_returns_are_type_errors"),
    C(f"{SCV}.defvjp_with_logs", "a key logged twice in one backward pass raises "
      "ValueError",
      "tests/test_api_parity.py::test_with_logs_nondiff_argnums_and_two_calls"),
    C(f"{SCV}.defvjp_with_accums", "when the installed jax.custom_vjp has no "
      "such method (before jax 0.12)",
      "tests/test_api_parity.py::test_missing_method_raises",
      raises="NotImplementedError"),
    C(f"{SCV}.defvjp_with_accums", "the cotangents are the same as "
      "jax.custom_vjp's", "tests/test_api_parity.py::test_with_accums_values"),
    C(f"{SCV}.defremat", "when the installed jax.custom_vjp has no such method "
      "(before jax 0.12)", "tests/test_api_parity.py::test_missing_method_raises",
      raises="NotImplementedError"),
    C(f"{SCV}.defremat", "when a rule is not callable",
      "test_defremat_rules_must_be_callable", raises="TypeError"),
    C(f"{SCV}.defremat", "its residuals res are kept whatever the remat policy "
      "says", "tests/test_api_parity.py::test_defremat_matches_jax"),
    C(f"{SCV}.defremat_with_logs", "when the installed jax.custom_vjp has no "
      "such method (before jax 0.12)",
      "tests/test_api_parity.py::test_missing_method_raises",
      raises="NotImplementedError"),
    C(f"{SCV}.defremat_with_logs", "when a rule is not callable",
      "test_defremat_rules_must_be_callable", raises="TypeError"),
    # filter_custom_vjp
    C(FCV, "where equinox's own runs fn_fwd in both",
      "tests/test_equinox.py::test_kernel_counts_vs_equinox"),
    C(FCV, "the backward pass fn_fwd + fn_bwd (or fn_fwd_bwd)",
      "tests/test_equinox.py::test_fused_rule"),
    C(FCV, "a value returned for a leaf that is not an inexact array is "
      "dropped", "test_filter_custom_vjp_rule_arguments"),
    C(FCV, "perturbed has vjp_arg's structure with a bool per leaf",
      "test_filter_custom_vjp_rule_arguments"),
    C(FCV, "with None for output leaves that are not differentiated",
      "test_filter_custom_vjp_rule_arguments"),
    C(FCV, "equinox is not installed", "test_filter_custom_vjp_needs_equinox",
      raises="ImportError"),
    C(f"{FCV}.__call__", "when the rules are not defined yet",
      "tests/test_equinox.py::test_not_yet_defined", raises="RuntimeError"),
    C(f"{FCV}.__call__", "when an array in args/kwargs is differentiated",
      "tests/test_equinox_python_scalars.py::test_differentiating_args_is_refused_as_in_equinox",
      raises="RuntimeError"),
    C(f"{FCV}.__call__", "does not have vjp_arg's pytree structure",
      "tests/test_equinox.py::test_bad_gradient_structure",
      raises="RuntimeError"),
    C(f"{FCV}.def_fwd", "Usable as a decorator; returns fn_fwd",
      "test_filter_custom_vjp_rule_arguments"),
    C(f"{FCV}.def_bwd", "Usable as a decorator; returns fn_bwd",
      "test_filter_custom_vjp_rule_arguments"),
    C(f"{FCV}.def_fwd_bwd", "Under remat it replaces fn_fwd + fn_bwd in the "
      "backward pass", "tests/test_equinox.py::test_fused_rule"),
    C(f"{FCV}.def_fwd_bwd", "True or False forces either pair",
      "tests/test_equinox.py::test_fused_forced_through_def_fwd_bwd"),
    C(f"{FCV}.def_fwd_bwd", "fused is not None, True or False",
      "tests/test_equinox.py::test_def_fwd_bwd_fused_must_be_a_bool",
      raises="TypeError"),
    # check_primals
    C("check_primals", "for an unknown mode or a negative tolerance",
      "test_check_primals_refuses_bad_settings_at_once", raises="ValueError"),
    C("check_primals", "when fwd's residuals are all inputs, fwd does not run",
      "test_check_primals_where_fwd_does_not_run"),
    C("check_primals", "so a fwd that is wrong there is not reported",
      "tests/test_check_primals.py::test_only_where_remat_runs_both"),
    C("check_primals", "Eagerly (no jit) \"raise\" raises "
      "PrimalMismatchError itself, without JAX's log of a failed callback",
      "tests/test_check_primals.py::test_only_where_remat_runs_both"),
    C("check_primals", "a jitted function retraces when it changes",
      "test_check_primals_retraces_and_decorates"),
    C("check_primals", 'jax.config.update("smartvjp_check_primals", "raise")',
      "tests/test_check_primals.py::test_global_option_and_bad_values"),
    C("check_primals", "under jit JAX surfaces it as its runtime error carrying "
      "this message", "test_primal_mismatch_error_eagerly_and_under_jit"),
    C("check_primals", '"warn" (a RuntimeWarning)',
      "tests/test_check_primals.py::test_warn_and_tolerance"),
    C("check_primals.__call__", "A function that calls func inside with self:",
      "test_check_primals_retraces_and_decorates"),
    C("PrimalMismatchError", "Raised by the check_primals(\"raise\") check when "
      "the computation runs eagerly",
      "test_primal_mismatch_error_eagerly_and_under_jit"),
    C("PrimalMismatchError", "A subclass of ValueError",
      "test_primal_mismatch_error_eagerly_and_under_jit"),
    # code you do not own
    C("import_swapped", "name does not exist (as importlib)",
      "tests/test_swap.py::test_missing_module_and_modules_without_source",
      raises="ModuleNotFoundError"),
    C("import_swapped", "name or an include entry is not an absolute module "
      "name", "tests/test_swap.py::test_bad_names_are_value_errors",
      raises="ValueError"),
    C("import_swapped", "it is JAX's core, jaxlib or smartvjp",
      "tests/test_swap.py::test_core_modules_are_never_copied",
      raises="SwapError"),
    C("import_swapped", "it has no Python source to run again",
      "tests/test_swap.py::test_missing_module_and_modules_without_source",
      raises="SwapError"),
    C("import_swapped", "it imports custom_vjp from one of JAX's private modules",
      "tests/test_swap.py::test_private_import_of_custom_vjp_is_refused",
      raises="SwapError"),
    C("import_swapped", "the copy still holds jax.custom_vjp functions",
      "tests/test_swap.py::test_custom_vjp_from_a_shared_module_needs_include",
      raises="SwapError"),
    C("import_swapped", "Other modules are shared, not copied, unless include "
      "names them",
      "tests/test_swap.py::test_custom_vjp_from_a_shared_module_needs_include"),
    C("import_swapped", "name's own submodules (of a package) are always copied",
      "tests/test_swap.py::test_a_package_is_copied_with_its_submodules"),
    C("import_swapped", "The copy is a different module object with different "
      "functions and classes", "test_import_swapped_copy_is_another_module"),
    C("import_swapped", "the previous entries and the parent package's "
      "attribute are restored afterwards",
      "tests/test_swap.py::test_import_swapped_changes_nothing_global"),
    C("import_swapped", "calls of import_swapped run one at a time",
      "tests/test_swap.py::test_import_swapped_from_threads"),
    C("import_swapped", "A module the copy imports later, inside a function "
      "that runs after this call returns, is the copy's",
      "test_import_swapped_copy_is_another_module"),
    C("import_swapped", "from pkg import sub with pkg.sub in include and pkg "
      "shared gets the copy's sub",
      "tests/test_swap.py::test_include_reaches_a_submodule_imported_from_its_package"),
    C("import_swapped", "the copy holds no custom_vjp function and no code "
      "that makes one",
      "tests/test_swap.py::test_a_copy_that_would_change_nothing_is_a_swap_error",
      raises="SwapError"),
    C("import_swapped", "it says so and names both fixes: the parent "
      "package, or that submodule in include",
      "tests/test_swap.py::test_a_module_that_re_exports_from_outside_the_copy_names_both_fixes",
      raises="SwapError"),
    C("import_swapped", "fails in its own code when copied alone: copy the "
      "package instead",
      "tests/test_swap.py::test_a_module_that_needs_its_package_mid_init_is_copied_with_it"),
    C("import_swapped", "reads sys.modules or calls importlib.import_module "
      "runs with the copy's modules in sys.modules",
      "tests/test_swap.py::test_import_swapped_copy_finds_its_own_modules"),
    C("import_swapped", "import_swapped warns (UserWarning, naming what was "
      "replaced)",
      "tests/test_swap.py::test_import_swapped_warns_where_the_copy_patches_a_shared_library"),
    C("swap_custom_vjp", "a submodule of a package first imported in it (not "
      "of the standard library or JAX) that is first imported later, inside a "
      "function when it runs (tensorcircuit's backends/jax_ops.py), is swapped",
      "tests/test_swap.py::test_swap_custom_vjp_reaches_submodules_imported_after_the_block"),
    C("swap_custom_vjp", "Entering the outermost such block (outside any "
      "transformation) clears JAX's caches",
      "tests/test_swap.py::test_existing_names_what_it_leaves_and_a_cached_trace"),
    C("swap_custom_vjp", "when jax.custom_vjp or "
      "jax.custom_derivatives.custom_vjp is no longer smart_custom_vjp",
      "tests/test_swap.py::test_replaced_inside_the_block_is_a_swap_error",
      raises="SwapError"),
    C("swap_custom_vjp", "functions decorated before the block: they stay "
      "jax.custom_vjp objects",
      "tests/test_swap.py::test_first_import_in_the_block_is_swapped_an_earlier_one_is_not"),
    C("swap_custom_vjp", "a function traced and cached by jax.jit inside the "
      "block keeps its smartvjp rules when called later",
      "tests/test_swap.py::test_a_trace_cached_in_the_block_keeps_smartvjp"),
    C("swap_custom_vjp", "a module that imports custom_vjp from one of JAX's "
      "private modules (those are never patched)",
      "test_swap_custom_vjp_leaves_jax_private_names_alone"),
    C("swap_custom_vjp", "The objects stay ``jax.custom_vjp`` functions, and "
      "a call outside the block is JAX's again",
      "tests/test_swap.py::test_existing_functions_run_as_smart_inside_the_block"),
    C("swap_custom_vjp", "the ``jax.custom_vjp`` functions JAX's own APIs make "
      "(``jax.custom_gradient``)",
      "tests/test_swap.py::test_existing_leaves_jax_own_and_unconvertible_functions_alone"),
    C("swap_report", "is neither a module nor callable, or a module is "
      "given with arguments to trace it on",
      "tests/test_swap.py::test_swap_report_rejects_what_it_cannot_report_on",
      raises="TypeError"),
    C("swap_report", "A ``jax.custom_vjp`` call made only inside another "
      "rule's ``fwd`` or ``bwd`` is not traced",
      "tests/test_swap.py::test_swap_report_of_a_program_nested_in_a_smart_function"),
    # smartvjp.testing.RunCounter
    C("testing.RunCounter", "once per run of a batched rule under jax.vmap "
      "(not once per example). Tracing counts nothing",
      "tests/test_run_counter.py::test_vmap_counts_one_run_per_batched_rule"),
    C("testing.RunCounter", "Tracing counts nothing",
      "tests/test_run_counter.py::test_tracing_counts_nothing_and_reset"),
    C("testing.RunCounter.count", "when no array is given, or name is not a "
      "string", "tests/test_run_counter.py::test_raises", raises="TypeError"),
    C("testing.RunCounter.count", "with the same shapes, dtypes and values",
      "tests/test_run_counter.py::test_values_pass_through_unchanged"),
    C("testing.RunCounter.reset", "Sets every count back to zero",
      "tests/test_run_counter.py::test_tracing_counts_nothing_and_reset"),
    C("testing.RunCounter", "is saved: fwd 1, bwd 1",
      "tests/test_run_counter.py::test_counts_what_a_removable_kernel_runs"),
    C("testing.RunCounter", "Where nothing reads any of the step's outputs, "
      "JAX's and XLA's dead-code elimination remove it",
      "tests/test_run_counter.py::test_the_count_is_removed_where_nothing_reads_it"),
    C("testing.RunCounter", "it no longer splits fwd (fwd[part=saved] forward "
      "and fwd[part=rest] backward) but runs f forward and fwd whole backward",
      "tests/test_run_counter.py::test_the_count_makes_a_jax_coded_fwd_a_kernel_as_the_docs_say"),
    C("testing.RunCounter", "so save_only_these_names saves nothing",
      "tests/test_run_counter.py::test_checkpoint_name_goes_on_the_count_s_output"),
    # smartvjp.print_schedule
    C("print_schedule", "for the same program the two agree",
      "tests/test_run_counter.py::test_print_schedule_places_what_the_counter_counts"),
    C("print_schedule", "[part=saved] / [part=rest] for the two sides of a "
      "fwd that a remat policy split",
      "tests/test_print_schedule.py::test_a_split_fwd_shows_both_parts_from_the_param"),
    C("print_schedule", "x4 in a scan of length 4, x? in a while",
      "tests/test_print_schedule.py::test_repeats_in_scan_and_while_and_nothing_to_show"),
    C("ScheduledRule", "None inside a while",
      "tests/test_print_schedule.py::test_repeats_in_scan_and_while_and_nothing_to_show"),
    C("ScheduledRule", "The equation's part param",
      "tests/test_print_schedule.py::test_a_split_fwd_shows_both_parts_from_the_param"),
    C("ScheduledRule", "\"jvp\" / \"lin\" for forward mode's",
      "tests/test_print_schedule.py::test_forward_mode_shows_the_jvp_equation"),
]


# -- the ties ---------------------------------------------------------------------------

def test_claims_quote_their_docstrings():
  wrong = []
  for c in CLAIMS:
    assert c.obj in DOCUMENTED, c
    where = (raises_entries(c.obj).get(c.raises, "") if c.raises
             else norm(doc(c.obj)))
    if norm(c.quote) not in where:
      wrong.append(c)
  assert not wrong, "\n".join(map(str, wrong))


def test_every_raises_entry_is_checked():
  for name in DOCUMENTED:
    for exc in raises_entries(name):
      assert any(c.obj == name and c.raises == exc for c in CLAIMS), (
          f"{name}: the Raises entry {exc} has no claim")


def test_every_bullet_is_checked():
  for name in DOCUMENTED:
    for item in bullets(name):
      assert any(c.obj == name and norm(c.quote) in item for c in CLAIMS), (
          f"{name}: no claim checks the bullet {item[:90]!r}")


def _test_functions(path):
  tree = ast.parse(open(path, encoding="utf-8").read())
  return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_claims_name_tests_that_exist():
  for c in CLAIMS:
    file, _, name = c.by.rpartition("::")
    path = os.path.join(ROOT, file) if file else __file__
    assert name.startswith("test_"), c
    assert name in _test_functions(path), c


def test_the_parsers_find_what_they_should():
  entries = raises_entries(f"{SCV}.__call__")
  assert set(entries) == {"AttributeError", "TypeError", "ValueError",
                          "jax.errors.UnexpectedTracerError",
                          "CustomVJPException", "smartvjp.NotTransposableError"}
  assert len(bullets(SCV)) == 10
  assert len(bullets("import_swapped")) == 7


def test_every_docstring_example_runs():
  """The fenced examples of the documented docstrings, each in a fresh
  namespace (the three long ones also in tests/test_readme_and_help.py)."""
  ran = 0
  for name in DOCUMENTED:
    for code in re.findall(r"^```python\n(.*?)^```", doc(name), re.S | re.M):
      if "equinox" in code:
        pytest.importorskip("equinox")
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(compile(code, f"{name}.__doc__", "exec"), {"__name__": "__doc__"})
      ran += 1
  assert ran == 8


# -- the checks of claims no other file checks directly ---------------------------------

X = jnp.linspace(-1.0, 1.0, 3)


def test_evaluation_runs_f_only():
  F, n = K.counting_sin(smart_custom_vjp, concrete=True)
  np.testing.assert_allclose(F(X), jnp.sin(X))      # f simply called
  assert dict(n) == {"f": 1}
  n.clear()
  F, n = K.counting_sin(smart_custom_vjp)
  jax.jit(F)(X)
  jax.make_jaxpr(F)(X)
  assert n["f"] >= 1 and n["fwd"] == n["bwd"] == 0


@pytest.mark.parametrize("program", ["eager grad", "eager vjp", "jit(grad)",
                                     "vmap(grad)"])
def test_direct_grad_does_not_trace_f(program):
  F, n = K.counting_sin(smart_custom_vjp, concrete=True)  # f fails on a tracer
  loss = lambda x: jnp.sum(F(x))
  run = {"eager grad": lambda: jax.grad(loss)(X),
         "eager vjp": lambda: jax.vjp(F, X)[1](X)[0],
         "jit(grad)": lambda: jax.jit(jax.grad(loss))(X),
         "vmap(grad)": lambda: jax.vmap(jax.grad(lambda x: F(x)))(X)}[program]
  np.testing.assert_allclose(run(), jnp.cos(X) * (X if program == "eager vjp"
                                                   else 1.0), rtol=1e-6)
  assert n["f"] == 0 and n["fwd"] == 1 and n["bwd"] == 1
  # the same with jax.custom_vjp: f runs nowhere either
  G, m = K.counting_sin(jax.custom_vjp, concrete=True)
  jax.grad(lambda x: jnp.sum(G(x)))(X)
  assert m["f"] == 0


def _named_rules(kernel):
  """(f, fwd, bwd) of sin(2 sin x): fwd names one residual "a" and computes
  another, "b", either in JAX or inside one opaque kernel."""
  def f(x):
    return jnp.sin(2.0 * jnp.sin(x))

  def fwd(x):
    if kernel:
      out, a, b = K.kernel("fwd", lambda x: (
          np.sin(2 * np.sin(x)), np.cos(2 * np.sin(x)), 2 * np.cos(x)),
          [x, x, x], x)
      a = jax.ad_checkpoint.checkpoint_name(a, "a")
      return out, (a, b)
    y = 2.0 * jnp.sin(x)
    a = jax.ad_checkpoint.checkpoint_name(jnp.cos(y), "a")
    return jnp.sin(y), (a, 2.0 * jnp.cos(x))

  def bwd(res, g):
    a, b = res
    return (a * b * g,)
  return f, fwd, bwd


def _forward_and_backward(F, policy):
  text = str(jax.make_jaxpr(jax.grad(
      lambda x: jnp.sum(jax.checkpoint(F, policy=policy)(x))))(X))
  forward, backward = text.split("remat2")
  return forward, backward


def test_partial_policy_splits_a_jax_coded_fwd():
  f, fwd, bwd = _named_rules(kernel=False)
  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd)
  policy = jax.checkpoint_policies.save_only_these_names("a")
  forward, backward = _forward_and_backward(F, policy)
  # the part of fwd computing the saved "a" forward, f nowhere; the rest of
  # fwd in the backward region, then bwd
  assert "smartvjp_fwd" in forward and "smartvjp_primal" not in forward
  assert "smartvjp_fwd" in backward and "smartvjp_bwd" in backward
  want = jax.grad(lambda x: jnp.sum(jax.checkpoint(f)(x)))(X)
  got = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(F, policy=policy)(x))))(X)
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_partial_policy_recomputes_an_opaque_fwd_whole():
  f, fwd, bwd = _named_rules(kernel=True)
  policy = jax.checkpoint_policies.save_only_these_names("a")
  launches = {}
  for name, deco in (("smart", smart_custom_vjp), ("jax", jax.custom_vjp)):
    F = deco(f)
    F.defvjp(fwd, bwd)
    loss = lambda x: jnp.sum(jax.checkpoint(F, policy=policy)(x) ** 2)
    K.reset()
    jax.block_until_ready(jax.jit(jax.grad(loss))(X))
    launches[name] = dict(K.COUNTS)
  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd)
  forward, backward = _forward_and_backward(F, policy)
  assert "smartvjp_primal" in forward and "smartvjp_fwd" not in forward
  assert "smartvjp_fwd" in backward
  assert launches["smart"] == {"fwd": 1}   # f is JAX code here: not counted
  assert launches["smart"]["fwd"] <= launches["jax"]["fwd"]


def _off_by_half():
  """f = sin; fwd's primal output is sin + 0.5 (so which ran shows)."""
  F = smart_custom_vjp(jnp.sin)
  F.defvjp(lambda x: (jnp.sin(x) + 0.5, jnp.cos(x)), lambda c, g: (c * g,))
  G = smart_custom_vjp(jnp.sin)
  G.defvjp(lambda x: (jnp.sin(x) + 0.5, x), lambda x, g: (jnp.cos(x) * g,))
  return F, G


def test_forward_value_is_fs_where_f_stands_in_for_fwd():
  F, G = _off_by_half()
  x = jnp.float32(0.0)
  value = lambda fn: float(fn(x))
  # the forward pass under remat
  assert value(lambda x: jax.value_and_grad(jax.checkpoint(F))(x)[0]) == 0.0
  # under jit, a fwd whose residuals are all inputs, f traced anyway (staged)
  assert value(jax.jit(lambda x: jax.value_and_grad(jax.jit(G))(x)[0])) == 0.0
  # ... but f is not traced for this alone: linearized where made, fwd's
  assert value(jax.jit(lambda x: jax.value_and_grad(G)(x)[0])) == 0.5
  # under jit, a call that no cotangent reaches, f traced anyway (staged)
  assert value(jax.jit(lambda x: jax.vjp(jax.jit(F), x)[0])) == 0.0
  # ... but not traced for this alone: linearized where made, fwd's value
  assert value(jax.jit(lambda x: jax.vjp(F, x)[0])) == 0.5
  # elsewhere fwd's, as with jax.custom_vjp
  assert value(lambda x: jax.value_and_grad(F)(x)[0]) == 0.5
  J = jax.custom_vjp(jnp.sin)
  J.defvjp(lambda x: (jnp.sin(x) + 0.5, jnp.cos(x)), lambda c, g: (c * g,))
  assert value(lambda x: jax.value_and_grad(jax.checkpoint(J))(x)[0]) == 0.5


def test_rules_traced_once_per_signature_and_program():
  state = {"scale": 1.0}
  n = collections.Counter()

  def f(x):
    n["f"] += 1
    return jnp.sin(x) * state["scale"]

  def fwd(x):
    n["fwd"] += 1
    return f(x), jnp.cos(x) * state["scale"]

  def bwd(c, g):
    n["bwd"] += 1
    return (c * g,)

  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd)
  twice = lambda x: jnp.sum(F(x)) + jnp.sum(F(x + 1.0))   # one signature
  jax.jit(jax.grad(twice))(X)
  assert n["fwd"] == 1 and n["bwd"] == 1
  n.clear()
  jax.make_jaxpr(jax.grad(twice))(X)
  assert n["fwd"] == 1 and n["bwd"] == 1
  n.clear()
  jax.grad(twice)(X)                   # eager: the rules run at each call
  assert n["fwd"] == 2 and n["bwd"] == 2
  # each new program reads the state afresh
  first = jax.jit(jax.grad(lambda x: jnp.sum(F(x))))(X)
  state["scale"] = 2.0
  second = jax.jit(jax.grad(lambda x: jnp.sum(F(x))))(X)
  np.testing.assert_allclose(second, 2.0 * first, rtol=1e-6)


def test_optimize_remat_changes_nothing():
  texts = []
  for flag in (False, True):
    F = smart_custom_vjp(jnp.sin)
    F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,),
             optimize_remat=flag)
    loss = lambda x: jnp.sum(jax.checkpoint(F)(x) ** 2)
    texts.append(re.sub(r"0x[0-9a-f]+", "", str(jax.make_jaxpr(jax.grad(loss))(X))))
  assert texts[0] == texts[1]


def test_nondiff_values_hashable_or_not():
  @functools.partial(smart_custom_vjp, nondiff_argnums=(1,))
  def scale(x, options):
    return x * options["k"]

  scale.defvjp(lambda x, o: (x * o["k"], None),
               lambda o, _, g: (g * o["k"],))       # nondiff arguments first
  opts = {"k": 3.0}                                  # a dict: unhashable
  np.testing.assert_allclose(jax.jit(jax.grad(
      lambda x: jnp.sum(scale(x, opts))))(X), 3.0 * jnp.ones(3))
  opts["k"] = 5.0                 # traced afresh at every call: not cached
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(scale(x, opts)))(X),
                             5.0 * jnp.ones(3))


def test_defvjp_type_errors():
  F = smart_custom_vjp(jnp.sin)
  fwd, bwd = (lambda x: (jnp.sin(x), jnp.cos(x))), (lambda c, g: (c * g,))
  with pytest.raises(TypeError, match="fwd must be callable"):
    F.defvjp("fwd", bwd)
  with pytest.raises(TypeError, match="symbolic_zeros"):
    F.defvjp(fwd, bwd, lambda x, g: (g,))          # fwd_bwd by position
  with pytest.raises(TypeError, match="generic_batching"):
    F.defvjp(fwd, bwd, False, False, lambda x, g: (g,))


def test_symbolic_zeros_reach_fwd_bwd():
  seen = {}

  def fwd_bwd(x, g):
    seen["x"] = type(x).__name__
    return (jnp.cos(x.value) * g,)

  F = smart_custom_vjp(jnp.sin)
  F.defvjp(symbolic_zeros=True, fwd_bwd=fwd_bwd)
  got = jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x)))(X)
  np.testing.assert_allclose(got, jnp.cos(X), rtol=1e-6)
  assert seen["x"] == "CustomVJPPrimal"


@pytest.mark.parametrize("deco", [smart_custom_vjp, jax.custom_vjp],
                         ids=["smartvjp", "jax"])
def test_fwd_primal_output_unchecked_where_f_is_not_traced(deco):
  """jax.grad applied directly traces only fwd, so nothing compares its
  primal output with f's, as with jax.custom_vjp."""
  F = deco(jnp.sin)
  F.defvjp(lambda x: (jnp.sin(x)[:1], jnp.cos(x)), lambda c, g: (c,))
  out, _ = jax.vjp(F, X)
  assert out.shape == (1,)


def test_f_returning_a_reference_is_a_value_error():
  if not hasattr(jax, "new_ref"):
    pytest.skip(f"jax {jax.__version__} has no jax.new_ref")
  F = smart_custom_vjp(lambda x: jax.new_ref(x))
  F.defvjp(lambda x: (jax.new_ref(x), None), lambda _, g: (g,))
  with pytest.raises(ValueError, match="reference"):
    jax.jit(F)(X)


def test_closure_errors_are_jaxs_types():
  from jax.errors import UnexpectedTracerError
  k = jnp.float32(2.0)

  def program(deco, wrap):
    def loss(k):
      F = deco(lambda x: jnp.sin(x * k))
      F.defvjp(lambda x: (jnp.sin(x * k), jnp.cos(x * k) * k),
               lambda c, g: (c * g,))
      return jnp.sum(wrap(F)(X * k))
    with pytest.raises(Exception) as info:
      jax.grad(loss)(k)
    return type(info.value)

  assert program(smart_custom_vjp, lambda F: F) is UnexpectedTracerError
  staged = program(smart_custom_vjp, jax.checkpoint)
  assert staged is program(jax.custom_vjp, jax.checkpoint)
  assert staged.__name__ == "CustomVJPException"
  assert not issubclass(staged, TypeError)


def test_defremat_rules_must_be_callable():
  if not hasattr(jax.custom_vjp, "defremat"):
    pytest.skip(f"jax {jax.__version__} lacks defremat")
  for method in ("defremat", "defremat_with_logs"):
    F = smart_custom_vjp(jnp.sin)
    with pytest.raises(TypeError, match="rem must be callable"):
      getattr(F, method)(lambda x: (jnp.sin(x), x), "rem", lambda r, g: (g,))


def test_filter_custom_vjp_rule_arguments():
  eqx = pytest.importorskip("equinox")
  seen = {}

  @smartvjp.filter_custom_vjp
  def fn(pair, x):
    w, steps = pair
    return {"y": jnp.sin(w) * x, "aux": jnp.cos(w) * x}

  def fn_fwd(perturbed, pair, x):
    seen["perturbed"] = perturbed
    return fn.fn(pair, x), None

  def fn_bwd(res, g, perturbed, pair, x):
    seen["g"] = g
    w, steps = pair
    return (jnp.cos(w) * x * g["y"], jnp.ones(()))   # a value for the int leaf

  assert fn.def_fwd(fn_fwd) is fn_fwd and fn.def_bwd(fn_bwd) is fn_bwd
  pair = (jnp.float32(0.5), jnp.int32(3))
  grads = eqx.filter_grad(lambda p: jnp.sum(fn(p, 2.0)["y"]))(pair)
  assert seen["perturbed"] == (True, False)       # vjp_arg's structure
  assert seen["g"]["aux"] is None                 # not differentiated
  np.testing.assert_allclose(grads[0], jnp.cos(0.5) * 2.0, rtol=1e-6)
  assert grads[1] is None                         # the int leaf's value dropped


def test_filter_custom_vjp_needs_equinox(monkeypatch):
  monkeypatch.setitem(sys.modules, "equinox", None)   # import fails
  fn = smartvjp.filter_custom_vjp(lambda a, x: a * x)  # constructing is fine
  with pytest.raises(ImportError, match="needs equinox"):
    fn.def_fwd_bwd(lambda g, p, a, x: g * x)


def test_check_primals_refuses_bad_settings_at_once():
  for bad in (dict(mode="loud"), dict(rtol=-1.0), dict(atol=-1e-9)):
    with pytest.raises(ValueError):
      smartvjp.check_primals(**bad)


def test_check_primals_where_fwd_does_not_run():
  _, G = _off_by_half()         # residuals all inputs: fwd runs nowhere
  loss = lambda x: jnp.sum(jax.checkpoint(G)(x))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with smartvjp.check_primals("raise"):
      jax.block_until_ready(jax.grad(loss)(X))
      jax.effects_barrier()


def test_check_primals_retraces_and_decorates():
  F, _ = _off_by_half()
  traces = collections.Counter()

  @jax.jit
  def grad(x):
    traces["grad"] += 1
    return jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x)))(x)

  grad(X)
  with pytest.warns(RuntimeWarning, match="disagree"):
    with smartvjp.check_primals("warn"):
      jax.block_until_ready(grad(X))          # traced again, with the check
      jax.effects_barrier()
  assert traces["grad"] == 2

  @smartvjp.check_primals("warn")
  def decorated(x):
    return jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x)))(x)

  with pytest.warns(RuntimeWarning, match="disagree"):
    jax.block_until_ready(decorated(X))
    jax.effects_barrier()


def test_primal_mismatch_error_eagerly_and_under_jit():
  F, _ = _off_by_half()
  loss = lambda x: jnp.sum(jax.checkpoint(F)(x))
  assert issubclass(smartvjp.PrimalMismatchError, ValueError)
  with smartvjp.check_primals("raise"):
    with pytest.raises(smartvjp.PrimalMismatchError, match="disagree"):
      jax.block_until_ready(jax.grad(loss)(X))
      jax.effects_barrier()
    with pytest.raises(jax.errors.JaxRuntimeError, match="disagree"):
      jax.block_until_ready(jax.jit(jax.grad(loss))(X))
      jax.effects_barrier()


LAZY_PKG = {
    "__init__.py": (
        "import jax\n\n"
        "@jax.custom_vjp\n"
        "def f(x):\n  return x\n\n"
        "f.defvjp(lambda x: (x, None), lambda r, g: (g,))\n\n"
        "def later():\n"
        "  from smartvjp_lazy_pkg import sub   # after the copy was made\n"
        "  return sub\n"),
    "sub.py": (
        "import jax\n\n"
        "@jax.custom_vjp\n"
        "def g(x):\n  return x\n\n"
        "g.defvjp(lambda x: (x, None), lambda r, g: (g,))\n"),
}


def test_import_swapped_copy_is_another_module(tmp_path, monkeypatch):
  package = tmp_path / "smartvjp_lazy_pkg"
  package.mkdir()
  for name, text in LAZY_PKG.items():
    (package / name).write_text(text)
  monkeypatch.syspath_prepend(str(tmp_path))
  for name in ("smartvjp_lazy_pkg", "smartvjp_lazy_pkg.sub"):
    monkeypatch.delitem(sys.modules, name, raising=False)
  import smartvjp_lazy_pkg as shared
  copy = smartvjp.import_swapped("smartvjp_lazy_pkg")
  again = smartvjp.import_swapped("smartvjp_lazy_pkg")
  # another module object each call, with its own functions
  assert copy is not shared and again is not copy
  assert sys.modules["smartvjp_lazy_pkg"] is shared
  assert isinstance(copy.f, smart_custom_vjp) and copy.f is not again.f
  assert not isinstance(shared.f, smart_custom_vjp)
  # a submodule the copy imports later, when its function runs, is the
  # copy's; the process's own is made as usual, unswapped
  sub = copy.later()
  assert isinstance(sub.g, smart_custom_vjp)
  assert "smartvjp_lazy_pkg.sub" not in sys.modules
  assert copy.later() is sub
  import smartvjp_lazy_pkg.sub as own
  assert own is not sub and not isinstance(own.g, smart_custom_vjp)
  monkeypatch.delitem(sys.modules, "smartvjp_lazy_pkg.sub", raising=False)


def test_swap_custom_vjp_leaves_jax_private_names_alone():
  import importlib
  private = importlib.import_module("jax._src.custom_derivatives")
  before = private.custom_vjp
  with smartvjp.swap_custom_vjp():
    assert jax.custom_vjp is smart_custom_vjp
    assert private.custom_vjp is before          # never patched
  assert jax.custom_vjp is before
