"""What the user's rules must satisfy, and the errors that say so: each
names the function and rule, the pytree path, and the expected against the
actual type. Cotangents are accepted as ``jax.custom_vjp`` accepts them
(``tests/test_cotangents.py`` runs a table through both); mutable array
references are refused where ``jax.custom_vjp`` refuses them."""

from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
from jax import tree_util

from smartvjp import _facade as jx


# As with JAX's own files: tracebacks of errors raised in (or through) the
# user's rules show the user's frames, not smartvjp's, and equations that
# smartvjp binds (residuals in jax.ad_checkpoint.print_saved_residuals) carry
# the user's source line.
jx.hide_frames_under(os.path.dirname(os.path.abspath(__file__)) + os.sep)

# the user's rule each role names (the role "fun" is f)
ROLE_NAMES = {"fun": "f", "fwd": "fwd", "bwd": "bwd", "fwd_bwd": "fwd_bwd",
              "jvp": "jvp"}


def function_name(fn) -> str:
  return getattr(fn, "__name__", None) or type(fn).__name__


def function_location(fn) -> str | None:
  for _ in range(8):
    code = getattr(fn, "__code__", None)
    if code is not None:
      return f"{code.co_filename}:{code.co_firstlineno}"
    inner = getattr(fn, "func", None) or getattr(fn, "__wrapped__", None)
    if inner is None:
      inner = getattr(type(fn), "__call__", None)
      if inner is None or getattr(inner, "__code__", None) is None:
        return None
    fn = inner
  return None


def rule_error(exc_type, rules, which: str, message: str) -> Exception:
  fn_name = rules.rule_name(which)
  where = (f"smart_custom_vjp function {rules.name}"
           if which == "fun" else
           f"the {ROLE_NAMES[which]} rule {fn_name} of smart_custom_vjp function "
           f"{rules.name}")
  loc = function_location(getattr(rules, which, None))
  at = "" if loc is None else f" ({ROLE_NAMES[which]} is defined at {loc})"
  return exc_type(f"{where} {message}{at}")


def describe_tree(x) -> str:
  leaves, tree = tree_util.tree_flatten(x)
  if len(leaves) > 8:
    return f"a value of type {type(x).__name__} with structure {tree}"
  return f"{x!r}" if len(repr(x)) < 200 else f"a value with structure {tree}"


def check_jax_leaves(tree, rules, which: str, what: str) -> None:
  for path, leaf in tree_util.tree_flatten_with_path(tree)[0]:
    try:
      jx.core.typeof(leaf)
    except TypeError:
      raise rule_error(
          TypeError, rules, which,
          f"returned {what} containing a value of type {type(leaf).__name__} "
          f"at {what}{tree_util.keystr(path)}, which is not a valid JAX type "
          f"(arrays, scalars and pytrees of them are).{_FIX.get(what, '')}"
      ) from None


_FIX = {
    "residuals": (
        " To hand bwd a value that is not an array (a string, a flag, a "
        "function), make it an argument listed in nondiff_argnums (bwd then "
        "receives it first: bwd(*nondiff_args, residuals, g)), or close over "
        "it in both fwd and bwd."),
}


# -- the types of the rules' outputs ----------------------------------------

def leaf_paths(tree) -> list[str]:
  leaves = tree_util.tree_unflatten(tree, [0] * tree.num_leaves)
  return [tree_util.keystr(p)
          for p, _ in tree_util.tree_flatten_with_path(leaves)[0]]


def blame_fwd(call, error: Exception) -> None:
  """Where ``f`` was never traced and ``bwd`` failed: names ``fwd`` when its
  primal output's types differ from ``f``'s (found with ``jax.eval_shape``,
  only on this error path)."""
  rules = call.rules
  if (call.eager is None and call.fwd_only is None) or rules.fwd is None:
    return
  primals = call.eager_primals or [
      jax.ShapeDtypeStruct(a.shape, a.dtype) for a in call.in_avals]
  try:
    want = jax.eval_shape(lambda *p: rules.fun(*call.full_args(p)), *primals)
  except Exception:  # noqa: BLE001 - f itself fails: nothing to compare
    return
  leaves, tree = tree_util.tree_flatten(want)
  if tree != call.out_tree:
    what = (f"whose pytree structure differs from {rules.name}'s output: "
            f"{rules.name} gives {tree}, fwd gives {call.out_tree}")
  else:
    what = None
    for path, w, got in zip(leaf_paths(tree), leaves, call.out_avals):
      if (w.shape, w.dtype) != (got.shape, got.dtype):
        want_type = jx.core.ShapedArray(w.shape, w.dtype).str_short()
        what = (f"that differs from {rules.name}'s at "
                f"{f'output{path}' if path else 'its output'}: {rules.name} "
                f"gives {want_type}, fwd gives {got.str_short()}")
        break
  if what is None:
    return
  blame = rule_error(
      type(error) if type(error) in (TypeError, ValueError) else TypeError,
      rules, "fwd",
      f"returned a primal output {what}; the bwd rule then failed on "
      f"cotangents of fwd's type ({type(error).__name__}: {error})")
  if type(error) in (TypeError, ValueError):
    raise blame from error
  error.add_note(f"smartvjp: {blame}")


def fwd_output_type_mismatches(call, fwd) -> list:
  """Outputs of the same shape and dtype whose full types (sharding, varying
  manual axes) differ between ``f`` and ``fwd``."""
  if fwd is None or not fwd.out_avals:
    return []
  return [(path, a, b) for path, a, b in
          zip(leaf_paths(call.out_tree), call.out_avals, fwd.out_avals)
          if (a.shape, a.dtype) == (b.shape, b.dtype)
          and not jx.core.typecompat(a, b)]


def check_fwd_output_types(call, fwd) -> None:
  bad = fwd_output_type_mismatches(call, fwd)
  if bad:
    path, want, got = bad[0]
    raise rule_error(
        TypeError, call.rules, "fwd",
        f"returned a primal output whose type differs from that of "
        f"{call.rules.name} (f) at output{path}: f gives {want.str_short()}, "
        f"fwd gives {got.str_short()}. Under jax.checkpoint f runs in the "
        "forward pass and fwd in the backward pass, so the two must agree "
        "in varying manual axes (shard_map) and sharding too; make f and "
        "fwd return the same type (for instance with "
        "jax.lax.pcast(x, axis_names, to='varying')).")


def check_primal_out(call, primal_out) -> None:
  if call.out_tree is None:   # eager differentiation: f has not run
    return
  rules = call.rules
  leaves, tree = tree_util.tree_flatten(primal_out)
  if tree != call.out_tree:
    raise rule_error(
        TypeError, rules, "fwd",
        "returned a primal output whose pytree structure differs from "
        f"{rules.name}'s output: expected {call.out_tree}, got {tree}.")
  for path, leaf, want in zip(leaf_paths(tree), leaves, call.out_avals):
    got = jx.core.typeof(leaf)
    if not jx.core.typecompat(want, got):   # as JAX compares, where f has run
      same = (got.shape, got.dtype) == (want.shape, want.dtype)
      raise rule_error(
          TypeError, rules, "fwd",
          f"returned a primal output that differs from {rules.name}'s output "
          f"at output{path}: expected {want.str_short()}, "
          f"got {got.str_short()}" + (
              "; shape and dtype agree, so the sharding or the varying manual "
              "axes (shard_map with check_vma=True) differ: make f and fwd "
              "return the same type (a kernel's result, such as a "
              "jax.pure_callback's, is typed invariant: jax.lax.pcast(x, "
              "axis_names, to='varying') makes it varying)." if same else "."))


# -- the cotangents a bwd or fwd_bwd rule returns ---------------------------------

def bwd_checks_disabled() -> bool:
  return bool(getattr(jax.config, "jax_disable_bwd_checks", False))


def _custom_vjp3() -> bool:
  """``jax_custom_vjp3`` takes cotangents as a list of any length, refusing
  a wrong length with ``ValueError``."""
  return bool(getattr(jax.config, "jax_custom_vjp3", False))


def zero_tangent(aval, symbolic: bool):
  zero = jx.ad_util.Zero(aval.to_tangent_aval())
  if symbolic:
    return jx.ad_util.SymbolicZero(zero.aval)
  return jx.ad.instantiate_zeros(zero)


_NO_CT = object()   # a None cotangent: no contribution to the input


def _spread(call, out, which) -> list:
  """One cotangent (or ``_NO_CT``) per primal leaf: ``None`` or one value
  may stand for a whole argument subtree."""
  rules = call.rules
  arg_trees = tree_util.treedef_children(call.in_tree)
  if isinstance(out, list) and (len(out) == len(arg_trees)
                                or _custom_vjp3()):
    out = tuple(out)   # (jax_custom_vjp3 takes a list of any length)
  if not isinstance(out, tuple):
    raise rule_error(
        TypeError, rules, which,
        f"must return a tuple with one cotangent (or None) per "
        f"differentiable argument of {rules.name}, i.e. of length "
        f"{len(arg_trees)} matching the structure {call.in_tree}, but "
        f"returned {describe_tree(out)}.")
  out_tree = tree_util.tree_structure(out, is_leaf=lambda x: x is None)
  dummy = tree_util.tree_unflatten(
      call.in_tree, [object() for _ in range(call.in_tree.num_leaves)])
  try:
    subtrees = out_tree.flatten_up_to(dummy)
  except ValueError:
    arity = len(out) != len(arg_trees)
    what = ("a tuple with one cotangent (or None) per differentiable "
            f"argument of {rules.name}, i.e. of length {len(arg_trees)}"
            if arity else "cotangents")
    raise rule_error(
        ValueError if arity and _custom_vjp3() else TypeError, rules, which,
        f"must return {what} matching the structure {call.in_tree} (None "
        f"or one array may stand for any subtree), but returned pytree "
        f"structure {out_tree}.") from None
  flat = []
  for ct, sub in zip(tree_util.tree_leaves(out, is_leaf=lambda x: x is None),
                     subtrees):
    count = len(tree_util.tree_leaves(sub))
    flat.extend([_NO_CT if ct is None else ct] * count)
  return flat


def _same_but_dtype(want, got) -> bool:
  """``jax.custom_vjp`` passes a cotangent of another dtype through where
  the input's cotangent is inexact or the dtype is extended."""
  if not (isinstance(want, jx.core.ShapedArray) and isinstance(got, jx.core.ShapedArray)):
    return False
  if want.shape != got.shape:
    return False
  if not jx.core.typecompat(want, got.update(dtype=want.dtype,
                                       weak_type=want.weak_type)):
    return False
  return (jax.dtypes.issubdtype(got.dtype, jax.dtypes.extended)
          or jnp.issubdtype(want.dtype, jnp.inexact))


def _accepts(want, got) -> bool:
  if jx.core.typecompat(want, got):
    return True
  inner = getattr(want, "inner_aval", None)   # a mutable array reference
  if inner is not None and jx.core.typecompat(inner.to_ct_aval(), got):
    return True
  return _same_but_dtype(want, got)


def flatten_cotangents(call, out, which: str) -> list:
  rules = call.rules
  flat = _spread(call, out, which)
  unchecked = bwd_checks_disabled()
  results = []
  for path, aval, ct in zip(leaf_paths(call.in_tree), call.in_avals, flat):
    ct_aval = aval.to_ct_aval()
    if ct is _NO_CT or ct_aval.dtype == jx.dtypes.float0:
      results.append(jx.ad_util.Zero(ct_aval))
      continue
    if type(ct) is jx.ad_util.SymbolicZero:
      if not jx.core.typecompat(ct_aval, ct.aval):
        raise rule_error(
            ValueError, rules, which,
            f"returned a SymbolicZero of type {ct.aval.str_short()} at "
            f"output{path}, but the corresponding input's cotangent type is "
            f"{ct_aval.str_short()} (input {aval.str_short()}); return None "
            "there for a zero cotangent.")
      results.append(jx.ad_util.Zero(ct.aval))
      continue
    try:
      got = jx.core.typeof(ct)
    except TypeError:
      raise rule_error(
          TypeError, rules, which,
          f"returned a value of type {type(ct).__name__} at "
          f"output{path}, which is not a JAX array.") from None
    if not unchecked and not _accepts(ct_aval, got):
      raise rule_error(
          ValueError, rules, which,
          f"returned a cotangent of type {got.str_short()} at "
          f"output{path}, but the corresponding input of {rules.name} has "
          f"type {aval.str_short()} (expected cotangent "
          f"{ct_aval.str_short()}){_sharding_hint(ct_aval, got)}.")
    results.append(ct)
  return results


def _sharding_hint(want, got) -> str:
  if (want.shape, want.dtype) != (got.shape, got.dtype):
    return ""
  return ("; shape and dtype agree, so the sharding or the varying manual "
          "axes (shard_map) differ, and a psum over the missing axes is "
          "usually what is needed")


# -- references ------------------------------------------------------------

def _checks_on() -> bool:
  return bool(jx.config.mutable_array_checks.value)


def argument_leaf_names(rules, num_args: int, in_tree) -> list[str]:
  params = _parameter_names(rules.fun, num_args)
  dyn = [i for i in range(num_args) if i not in rules.nondiff_argnums]
  skeleton = tree_util.tree_unflatten(in_tree, [0] * in_tree.num_leaves)
  names = []
  for path, _ in tree_util.tree_flatten_with_path(skeleton)[0]:
    names.append(params[dyn[path[0].idx]] + tree_util.keystr(path[1:]))
  return names


def _parameter_names(fun, num_args: int) -> list[str]:
  try:
    sig = inspect.signature(fun)
  except (TypeError, ValueError):
    return [f"args[{i}]" for i in range(num_args)]
  named, rest = [], None
  for p in sig.parameters.values():
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      named.append(p.name)
    elif p.kind is p.VAR_POSITIONAL:
      rest = p.name
  rest = rest or "args"
  return [named[i] if i < len(named) else f"{rest}[{i - len(named)}]"
          for i in range(num_args)]


def primal_value(x):
  return x.value if isinstance(x, jx.cd.CustomVJPPrimal) else x


def _is_ref(x) -> bool:
  """A mutable array reference (``jax.new_ref``) or its tracer."""
  try:
    return isinstance(jx.core.typeof(x), jx.state_types.AbstractRef)
  except TypeError:
    return False


def aliased_refs(leaves) -> list:
  if not _checks_on():
    return []
  first, pairs = {}, []
  for j, x in enumerate(leaves):
    x = primal_value(x)
    if _is_ref(x):
      i = first.setdefault(id(jx.core.get_referent(x)), j)
      if i != j:
        pairs.append((i, j))
  return pairs


def check_aliased_arguments(rules, role: str, num_args: int, in_tree,
                            primals) -> None:
  pairs = aliased_refs(primals)
  if not pairs:
    return
  i, j = pairs[0]
  names = argument_leaf_names(rules, num_args, in_tree)
  leaf = primal_value(primals[j])
  raise rule_error(
      ValueError, rules, role,
      f"received one mutable array through two differentiable arguments, "
      f"{names[i]} and {names[j]} (a reference of type "
      f"{jx.core.typeof(leaf).str_short()}); pass each mutable array at "
      "most once among the differentiable arguments, since bwd returns one "
      "cotangent per argument.")


def check_aliased_refs(call, primals) -> None:
  """As ``check_aliased_arguments``, for ``fwd`` of a traced call."""
  check_aliased_arguments(call.rules, "fwd", call.num_args, call.in_tree,
                          primals)


def _refuse_refs(rules, role: str, out, where: str, advice: str) -> None:
  for path, leaf in tree_util.tree_flatten_with_path(out)[0]:
    if _is_ref(leaf):
      raise rule_error(
          ValueError, rules, role,
          f"returned a mutable array reference of type "
          f"{jx.core.typeof(leaf).str_short()}{where}"
          f"{_at('output', tree_util.keystr(path))}; {advice}")


def _at(what: str, path: str) -> str:
  return f" at {what}{path}" if path else ""


def check_f_output(rules, out) -> None:
  if _checks_on():
    _refuse_refs(rules, "fun", out, "", "f must return values: read the "
                 "reference (ref[...]) to return its value.")


def check_fwd_output(rules, primal_out, res, primals) -> None:
  if _checks_on():
    _refuse_refs(rules, "fwd", primal_out, " in its primal output",
                 "like f, fwd must return values there (residuals may hold "
                 "the references fwd received as arguments).")
  passed = {id(primal_value(p)) for p in primals}
  for path, leaf in tree_util.tree_flatten_with_path(res)[0]:
    leaf = primal_value(leaf)
    if _is_ref(leaf) and id(leaf) not in passed:
      raise rule_error(
          ValueError, rules, "fwd",
          f"returned a mutable array reference of type "
          f"{jx.core.typeof(leaf).str_short()} among its residuals"
          f"{_at('residuals', tree_util.keystr(path))} that is not one of its "
          "differentiable arguments; only references passed to fwd can be "
          "residuals (bwd receives them to write into).")


def argument_position(leaf, primals):
  leaf = primal_value(leaf)
  if not _is_ref(leaf):
    return None
  for i, p in enumerate(primals):
    if primal_value(p) is leaf:
      return i
  raise RuntimeError(
      "smartvjp internal error: a residual reference that fwd did not "
      "receive passed the check; please report this with the program.")
