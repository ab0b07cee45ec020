"""Error messages that name the user's rule, the pytree path and the types."""

from __future__ import annotations

import os

from jax import tree_util

from smartvjp import _facade as jx

# As with JAX's own files: tracebacks of errors raised in (or through) the
# user's rules show the user's frames, not smartvjp's, and equations that
# smartvjp binds (residuals in jax.ad_checkpoint.print_saved_residuals) carry
# the user's source line.
jx.hide_frames_under(os.path.dirname(os.path.abspath(__file__)) + os.sep)

_ROLE = {"fun": "f", "fwd": "fwd", "bwd": "bwd", "fwd_bwd": "fwd_bwd",
         "jvp": "jvp"}


def function_name(fn) -> str:
  """The name errors give a user's function: its ``__name__``, else its
  type's (never an object's address)."""
  return getattr(fn, "__name__", None) or type(fn).__name__


def rule_error(exc_type, rules, which: str, message: str) -> Exception:
  """``exc_type`` whose message starts with the rule's role and user name."""
  fn_name = rules.rule_name(which)
  where = (f"smart_custom_vjp function {rules.name}"
           if which == "fun" else
           f"the {_ROLE[which]} rule {fn_name} of smart_custom_vjp function "
           f"{rules.name}")
  return exc_type(f"{where} {message}")


def describe_tree(x) -> str:
  leaves, tree = tree_util.tree_flatten(x)
  if len(leaves) > 8:
    return f"a value of type {type(x).__name__} with structure {tree}"
  return f"{x!r}" if len(repr(x)) < 200 else f"a value with structure {tree}"


def check_jax_leaves(tree, rules, which: str, what: str) -> None:
  """Raises ``TypeError`` naming the path of the first non-JAX leaf."""
  for path, leaf in tree_util.tree_flatten_with_path(tree)[0]:
    try:
      jx.get_aval(leaf)
    except TypeError:
      raise rule_error(
          TypeError, rules, which,
          f"returned {what} containing a value of type {type(leaf).__name__} "
          f"at {what}{tree_util.keystr(path)}, which is not a valid JAX type "
          "(arrays, scalars and pytrees of them are).") from None


def expect_used_up(it, what: str) -> None:
  """Raises ``RuntimeError`` (a smartvjp bug, never the user's) when the
  iterator ``it`` still has items; a check that ``python -O`` keeps."""
  end = object()
  if next(it, end) is not end:
    raise RuntimeError(
        f"smartvjp internal error: more {what} than expected; please report "
        "this with the program that raised it.")
