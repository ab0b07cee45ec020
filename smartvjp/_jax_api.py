"""``jax.custom_vjp``'s newer definition methods in terms of ``defvjp``,
each where the installed JAX has it. ``defvjp_with_accums``: value
accumulators, read back. ``defremat``: ``fwd`` keeps its residuals, ``rem``
then ``bwd`` backward. Logs leave the backward pass as JAX's do: the
wrapped ``bwd`` drops them into the innermost :func:`collecting_logs`
sink, the traced rule makes them outputs, and ``smartvjp_lin``'s transpose
returns them."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from typing import Callable

from jax import tree_util

from smartvjp import _facade as jx
from smartvjp._checks import function_name, primal_value
from smartvjp import _versions

# The JAX release that added each method (or defvjp's parameter).
INTRODUCED = {
    "defvjp_with_logs": "0.11.2",
    "defvjp_with_accums": "0.12.0",
    "defremat": "0.12.0",
    "defremat_with_logs": "0.12.0",
    "generic_batching": "0.12.0",
}


# Whether the installed jax.custom_vjp has each (``_versions``).
_HAS = {
    "defvjp_with_logs": _versions.TRANSPOSE_RETURNS_LOGS,
    "defvjp_with_accums": _versions.CUSTOM_VJP_METHODS_0_12,
    "defremat": _versions.CUSTOM_VJP_METHODS_0_12,
    "defremat_with_logs": _versions.CUSTOM_VJP_METHODS_0_12,
    "generic_batching": _versions.CUSTOM_VJP_METHODS_0_12,
}


# The oldest Python that jax 0.11 and newer install on (pip picks jax 0.10.2
# on Python 3.11).
NEWER_JAX_NEEDS_PYTHON = (3, 12)


def upgrade_advice(release: str, python=None) -> str:
  python = tuple((python or sys.version_info)[:2])
  if python < NEWER_JAX_NEEDS_PYTHON:
    need = ".".join(map(str, NEWER_JAX_NEEDS_PYTHON))
    return (f"jax {release} needs Python {need} or newer and this is Python "
            f"{python[0]}.{python[1]}: upgrade JAX in a Python {need}+ "
            "environment")
  return f"Upgrade JAX to {release} or newer"


def require_method(fun, method: str, generic_batching) -> None:
  if not _HAS[method]:
    import jax
    raise NotImplementedError(
        f"smart_custom_vjp function {function_name(fun)}: {method} mirrors "
        f"jax.custom_vjp.{method}, which JAX added in jax "
        f"{INTRODUCED[method]}; the installed jax {jax.__version__} does not "
        f"have it. {upgrade_advice(INTRODUCED[method])}, or use defvjp.")
  check_generic_batching(fun, method, generic_batching)


def check_generic_batching(fun, method: str, value) -> None:
  if value is None:
    return
  if not isinstance(value, (bool, int)) or callable(value):
    raise TypeError(
        f"smart_custom_vjp function {function_name(fun)}: {method}'s fifth "
        f"argument is generic_batching (a bool), got {type(value).__name__}"
        "; the fused rule is keyword-only: defvjp(fwd, bwd, fwd_bwd=...).")
  if not _HAS["generic_batching"]:
    import jax
    raise NotImplementedError(
        f"smart_custom_vjp function {function_name(fun)}: {method}'s "
        "generic_batching parameter mirrors jax.custom_vjp's, which JAX added "
        f"in jax {INTRODUCED['generic_batching']}; the installed jax "
        f"{jax.__version__} does not have it. "
        f"{upgrade_advice(INTRODUCED['generic_batching'])}, or leave "
        "generic_batching out.")


# -- logs ----------------------------------------------------------------------

_SINK: contextvars.ContextVar = contextvars.ContextVar(
    "smartvjp_logs", default=None)


@contextlib.contextmanager
def collecting_logs():
  sink: list = []
  token = _SINK.set(sink)
  try:
    yield sink
  finally:
    _SINK.reset(token)


def deposit_logs(logs) -> None:
  sink = _SINK.get()
  if sink is not None and logs:
    sink.append(logs)


def merged_logs(sink) -> dict | None:
  """One dict (``None`` where none); a key logged twice is an error."""
  if not sink:
    return None
  out: dict = {}
  for logs in sink:
    for key in logs:
      if key in out:
        raise ValueError(
            f"two backward-pass logs of smart_custom_vjp rules use the key "
            f"{key!r}; each key may appear once per backward pass.")
    out.update(logs)
  return out


def _check_logs(fun, rule, method, logs):
  if logs is not None and type(logs) is not dict:
    raise TypeError(
        f"smart_custom_vjp function {function_name(fun)}: bwd rule {function_name(rule)} "
        f"was defined with {method}, so its logs must be None or a dict, "
        f"but it returned logs of type {type(logs).__name__}.")


def without_logs(fun, bwd: Callable, method: str) -> Callable:
  @functools.wraps(bwd)
  def plain_bwd(*args):
    out = bwd(*args)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
          f"smart_custom_vjp function {function_name(fun)}: bwd rule {function_name(bwd)} "
          f"was defined with {method}, so each call must produce a pair "
          f"(cotangents, logs); it returned a {type(out).__name__}"
          f"{f' of length {len(out)}' if isinstance(out, (tuple, list)) else ''}.")
    cts, logs = out
    _check_logs(fun, bwd, method, logs)
    deposit_logs(logs)
    return cts
  return plain_bwd


# -- residuals that carry the differentiable arguments -------------------------

def _split(nondiff_argnums, args):
  return tuple(a for i, a in enumerate(args) if i not in nondiff_argnums)


def _merge(nondiff_argnums, nondiff, dyn):
  fixed, rest = dict(zip(nondiff_argnums, nondiff)), iter(dyn)
  return [fixed[i] if i in fixed else next(rest)
          for i in range(len(fixed) + len(dyn))]


def _values(args):
  return tree_util.tree_map(
      primal_value, args, is_leaf=lambda x: isinstance(x, jx.cd.CustomVJPPrimal))


def with_arguments(fwd: Callable, nondiff_argnums) -> Callable:
  @functools.wraps(fwd)
  def fwd_and_args(*args):
    out, res = fwd(*args)
    return out, (res, _values(_split(nondiff_argnums, args)))
  return fwd_and_args


# -- defvjp_with_accums -----------------------------------------------------------

_ACCUMULATORS = (jx.ad.ValAccum, jx.ad.NullAccum)


def _accumulator(ct):
  """What ``bwd`` receives for an input whose cotangent type is ``ct`` when
  nothing wraps the rule: a value accumulator (a null one for ``float0``)."""
  if getattr(ct, "dtype", None) == jx.dtypes.float0:
    return jx.ad.NullAccum(ct)
  return jx.ad.ValAccum(ct)


def _accumulated(accumulator):
  """What an accumulator holds: an array, or ``None`` (nothing or zeros)."""
  if not isinstance(accumulator, jx.ad.ValAccum):
    return None
  value = accumulator.freeze()
  return None if isinstance(value, jx.ad_util.Zero) else value


def accums_bwd(fun, bwd: Callable, num_nondiff: int) -> Callable:
  @functools.wraps(bwd)
  def plain_bwd(*args):
    nondiff, (res, dyn), g = args[:num_nondiff], args[num_nondiff], args[-1]
    accums = tree_util.tree_map(
        lambda x: _accumulator(jx.core.typeof(x).to_ct_aval()), dyn)
    logs = bwd(*nondiff, res, g, *accums)
    _check_logs(fun, bwd, "defvjp_with_accums", logs)
    deposit_logs(logs)
    return tuple(tree_util.tree_map(_accumulated, a, is_leaf=lambda x:
                                    isinstance(x, _ACCUMULATORS))
                 for a in accums)
  return plain_bwd


# -- defremat ------------------------------------------------------------------

def remat_bwd(fun, rem: Callable, bwd: Callable, nondiff_argnums,
              with_logs: bool) -> Callable:
  rule = without_logs(fun, bwd, "defremat_with_logs") if with_logs else bwd
  k = len(nondiff_argnums)

  @functools.wraps(bwd)
  def rem_then_bwd(*args):
    nondiff, (res, dyn), g = args[:k], args[k], args[-1]
    full = _merge(nondiff_argnums, nondiff, dyn)
    pair = rem(res, *full)
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
      raise TypeError(
          f"smart_custom_vjp function {function_name(fun)}: rem rule {function_name(rem)} "
          "must return a pair (primal_output, residuals for bwd), but "
          f"returned a {type(pair).__name__}.")
    return rule(*nondiff, pair[1], g)
  return rem_then_bwd
