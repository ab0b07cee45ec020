"""The optional forward rule ``defvjp(..., jvp=...)``, with a
``jax.custom_jvp`` rule's signature: forward mode runs it instead of
transposing ``bwd`` (an opaque kernel's only way to forward mode). The
linear map gets the primals it needs as residuals after ``fwd``'s own
(``FwdSpec.jvp_primals``)."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
from jax import tree_util

from smartvjp import _facade as jx
from smartvjp._checks import (
    describe_tree, function_name, leaf_paths, rule_error, zero_tangent)


def forward_mode_on_call() -> bool:
  """``jax.jvp`` (``jax.jacfwd``) applied directly to the call, eagerly or
  under ``jit``: there ``jax.custom_vjp`` refuses before tracing ``f``, so
  an ``f`` that cannot be traced must not surface its own error."""
  return isinstance(jx.core.trace_ctx.trace, jx.ad.JVPTrace)


def forward_mode_refusal(e: Exception, rules, which: str,
                         applies: bool = True):
  """Forward mode traces ``which`` (``"fun"``, ``"fwd"``); where it could
  not be traced on values (``e``: NumPy in the rule), JAX refuses to
  differentiate: the forward-mode ``TypeError`` naming ``jvp=``, to raise
  from ``e``. ``None`` (re-raise ``e``) for our own checks of a rule's
  result, and where ``applies`` is false (where ``jax.custom_vjp`` traces
  the rule too). Called only on the error path, so the call's own path
  gains no frame."""
  if not applies or raised_by_smartvjp(e):
    return None
  role = "f" if which == "fun" else which
  fix = (f"it also traces {role} where a forward rule is given, to know "
         f"the call's outputs: make {role} traceable" if rules.jvp is not None
         else f"where a rule cannot be (NumPy, a library's eager "
         f"wrapper), give a forward rule: {rules.name}.defvjp(..., "
         f"jvp=rule), with rule(primals, tangents) -> (primal_out, "
         f"tangent_out) as for jax.custom_jvp")
  return forward_mode_error_type(type(e))(
      f"forward-mode differentiation (jax.jvp, jax.jacfwd) of "
      f"smart_custom_vjp function {rules.name} traces its {role} "
      f"({rules.rule_name(which)}), which JAX could not trace on these "
      f"values (JAX said: {type(e).__name__}: "
      f"{str(e).splitlines()[0].rstrip('. ') if str(e) else ''}). "
      f"jax.custom_vjp refuses forward mode outright; smartvjp runs it "
      f"through rules written in JAX; {fix}.")


def raised_by_smartvjp(e: BaseException) -> bool:
  """Raised in smartvjp's own code (a check of a rule's result), not
  inside the user's rule or what it called."""
  tb = e.__traceback__
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  return tb is not None and os.path.dirname(
      os.path.abspath(tb.tb_frame.f_code.co_filename)) == _PACKAGE_DIR


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class NotTransposableError(TypeError):
  """Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``,
  ``jax.linearize``) of a ``smart_custom_vjp`` function that smartvjp could
  not carry out: a ``bwd`` (or ``fwd_bwd``) that JAX cannot transpose in its
  cotangent, or an ``f`` or ``fwd`` that JAX cannot trace, and no forward
  rule (``defvjp(..., jvp=...)``). A ``TypeError``, as ``jax.custom_vjp``'s
  refusal of forward mode is. The error the rule raised is its
  ``__cause__``; where that was not a ``TypeError`` (a callback's
  ``ValueError``), the exception is an instance of its type too
  (``forward_mode_error_type``), as ``jax.custom_vjp`` raises that type
  where it differentiates the rule itself."""

  __module__ = "smartvjp"


@functools.cache
def forward_mode_error_type(cause: type) -> type:
  """``NotTransposableError``, or a subclass of it and of ``cause`` (the
  rule's own error type) where that is not a ``TypeError``: caught by
  either name, printed as ``smartvjp.NotTransposableError``."""
  if issubclass(cause, TypeError) or issubclass(TypeError, cause):
    return NotTransposableError
  try:
    return type("NotTransposableError", (NotTransposableError, cause),
                {"__module__": "smartvjp",
                 "__doc__": NotTransposableError.__doc__})
  except TypeError:   # base classes whose instance layouts conflict
    return NotTransposableError


@dataclasses.dataclass(frozen=True, eq=False)
class JvpRule:
  fn: Callable

  @property
  def __name__(self) -> str:   # what errors call the rule
    return function_name(self.fn)

  def run(self, call, primals, in_nz, nz_tangents) -> tuple[list, list]:
    """On flat leaves; a tangent per ``call.out_nz`` output; raises
    ``TypeError`` naming the rule and path where the result does not fit."""
    it = iter(nz_tangents)
    tangents = [next(it) if nz else zero_tangent(a, call.rules.symbolic_zeros)
                for a, nz in zip(call.in_avals, in_nz)]
    py_primals = tree_util.tree_unflatten(call.in_tree, list(primals))
    py_tangents = tree_util.tree_unflatten(call.in_tree, tangents)
    with jax.named_scope(call.scopes["jvp"]):
      pair = self.fn(*call.nondiff, tuple(py_primals), tuple(py_tangents))
    return _checked(call, pair)


def _checked(call, pair) -> tuple[list, list]:
  rules = call.rules
  if not isinstance(pair, (tuple, list)) or len(pair) != 2:
    raise rule_error(TypeError, rules, "jvp",
                     "must return a pair (primal_output, tangent_output), "
                     f"but returned {describe_tree(pair)}.")
  primal_out, tangent_out = pair
  out_leaves, out_tree = tree_util.tree_flatten(primal_out)
  if call.out_tree is not None and out_tree != call.out_tree:
    raise rule_error(
        TypeError, rules, "jvp",
        "returned a primal output whose pytree structure differs from "
        f"{rules.name}'s output: expected {call.out_tree}, got {out_tree}.")
  is_zero = lambda x: isinstance(x, jx.ad_util.SymbolicZero)
  t_leaves, t_tree = tree_util.tree_flatten(tangent_out, is_leaf=is_zero)
  if t_tree != out_tree:
    raise rule_error(
        TypeError, rules, "jvp",
        "returned a tangent output whose pytree structure differs from its "
        f"primal output's: expected {out_tree}, got {t_tree}.")
  want_avals = call.out_avals or [jx.core.typeof(x) for x in out_leaves]
  nz_out = []
  for path, leaf, t, want in zip(leaf_paths(out_tree), out_leaves, t_leaves,
                                 want_avals):
    where = f"output{path}" if path else "its output"
    got = jx.core.typeof(leaf)
    if (got.shape, got.dtype) != (want.shape, want.dtype):
      raise rule_error(
          TypeError, rules, "jvp",
          f"returned a primal output that differs from {rules.name}'s at "
          f"{where}: expected {want.str_short()}, got {got.str_short()}.")
    want_t = want.to_tangent_aval()
    if want_t.dtype == jx.dtypes.float0:
      continue   # integer output: no tangent
    if is_zero(t):
      nz_out.append(jnp.zeros(want_t.shape, want_t.dtype))
      continue
    got_t = jx.core.typeof(t)
    if (got_t.shape, got_t.dtype) != (want_t.shape, want_t.dtype):
      raise rule_error(
          TypeError, rules, "jvp",
          f"returned a tangent at {where} of type {got_t.str_short()}, but "
          f"the primal output's tangent type is {want_t.str_short()}.")
    nz_out.append(t)
  return out_leaves, nz_out


def tangents_only(call, primals, in_nz, nz_tangents, rule=None) -> list:
  """The rule's tangent part alone, traced and its primal part removed, so
  an opaque primal kernel does not run again."""
  args = [*primals, *nz_tangents]
  avals = tuple(jx.core.typeof(a) for a in args)
  n = len(primals)
  key = ("jvp", avals, tuple(in_nz), jx.config.trace_context())
  hit = call.rule_cache.get(key) if rule is None else None
  if hit is None:
    run = (rule or call.rules.jvp).run

    def flat(*xs):
      return run(call, xs[:n], in_nz, xs[n:])[1]
    closed, consts = jx.trace_to_closed_jaxpr(
        flat, avals, "smart_custom_vjp jvp", call.rules.jvp.fn, avals)
    hit = (jx.dce_jaxpr_keep_inputs(closed, [True] * len(closed.out_avals)),
           consts)
    if rule is None:
      call.rule_cache.put(key, hit, consts)
  jaxpr, consts = hit
  with jax.named_scope(call.scopes["jvp"]):
    return jx.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *consts, *args)


@dataclasses.dataclass(frozen=True, eq=False)
class BatchedJvpRule:
  inner: "JvpRule | BatchedJvpRule"
  call: object
  in_dims: tuple
  vmapped: Callable
  t_dims: tuple | None = None   # the nonzero tangents' dims, if not as primals

  @property
  def __name__(self) -> str:
    return self.inner.__name__

  @property
  def fn(self) -> Callable:
    return self.inner.fn

  def run(self, bcall, primals, in_nz, nz_tangents) -> tuple[list, list]:
    del bcall

    def one(ps, ts):
      outs, touts = self.inner.run(self.call, ps, in_nz, ts)
      return tuple(outs), tuple(touts)
    t_dims = (list(self.t_dims) if self.t_dims is not None else
              [d for d, nz in zip(self.in_dims, in_nz) if nz])
    outs, touts = self.vmapped(one, (list(self.in_dims), t_dims))(
        list(primals), list(nz_tangents))
    return list(outs), list(touts)
