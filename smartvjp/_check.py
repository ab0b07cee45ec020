"""Opt-in numerics check (``check_primals``): under remat the forward pass
uses ``f``'s value and the backward region ``fwd``'s (or ``fwd_bwd``'s
cotangents in place of ``bwd``'s after ``fwd``), so they had better
agree."""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import jax
import numpy as np

from smartvjp import _facade as jx

option = jx.define_string_option(
    "smartvjp_check_primals",
    "Compare f's and fwd's primal outputs where both run (remat), and "
    "fwd_bwd's cotangents with bwd's after fwd where fwd_bwd runs: "
    "'warn' or 'raise', optionally followed by ':rtol:atol'.")


def _settings():
  value = option.value
  if not value or value == "off":
    return "off", 0.0, 0.0
  mode, *tols = value.split(":")
  if mode not in ("warn", "raise") or len(tols) not in (0, 2):
    raise ValueError(
        f"smartvjp_check_primals must be 'off', 'warn' or 'raise', optionally "
        f"followed by ':rtol:atol'; got {value!r}.")
  rtol, atol = (float(t) for t in tols) if tols else (1e-5, 1e-6)
  return mode, rtol, atol


class PrimalMismatchError(ValueError):
  """``f`` and ``fwd`` disagree on the primal output beyond the tolerance
  (or ``fwd_bwd`` and ``bwd`` after ``fwd`` on a cotangent).

  Raised by the ``check_primals("raise")`` check when the computation runs
  eagerly; under ``jit`` JAX raises its own runtime error
  (``jax.errors.JaxRuntimeError``) whose message carries this one. A
  subclass of ``ValueError``.
  """


class check_primals(contextlib.ContextDecorator):
  """Checks ``f`` against ``fwd`` wherever remat runs both, inside it.

  Under remat the forward pass uses ``f``'s output and the backward pass the
  residuals of ``fwd``, so the two must compute the same primal output.
  Inside ``with check_primals(...):`` (or in a function decorated with it),
  every rematerialized call whose ``fwd`` computes residuals also runs ``f``
  in the backward pass and compares the two outputs on the host, leaf by
  leaf. Those are the only places where ``f``'s value meets ``fwd``'s
  residuals, so the only ones checked: without remat, or under a policy
  that saves ``fwd``'s residuals, ``fwd`` alone runs (as with
  ``jax.custom_vjp``) and ``f`` is never used, so a ``fwd`` that is wrong
  there is not reported; when ``fwd``'s residuals are all inputs, ``fwd``
  does not run. Where a call also has a fused ``fwd_bwd`` and the backward
  region runs it, the check also runs ``fwd`` then ``bwd`` there and
  compares ``fwd_bwd(*args, g)`` with ``bwd(fwd(*args)[1], g)``, cotangent
  leaf by leaf, with the same tolerances and mode: a ``fwd_bwd`` that
  disagrees (say, one written with ``bwd``'s signature by mistake) would
  otherwise change the gradient under ``jax.checkpoint`` only, silently.
  Eagerly (no ``jit``) ``"raise"`` raises
  ``PrimalMismatchError`` itself, without JAX's log of a failed callback.
  The setting is read when a program is traced, and is part of JAX's trace
  context, so a jitted function retraces when it changes. The same check can be turned on globally with
  ``jax.config.update("smartvjp_check_primals", "raise")`` (or ``"warn"``,
  optionally followed by ``":rtol:atol"``). Example (self-contained; it
  runs as written):

  ```python
  import warnings
  import jax
  import jax.numpy as jnp
  import smartvjp

  @smartvjp.smart_custom_vjp
  def f(x):
    return jnp.sin(x)

  def f_fwd(x):                 # a bug: its output is not f's
    return jnp.sin(x) + 0.1, jnp.cos(x)

  f.defvjp(f_fwd, lambda c, g: (c * g,))
  loss = lambda x: jnp.sum(jax.checkpoint(f)(x))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with smartvjp.check_primals("warn"):
      jax.grad(loss)(jnp.ones(3))
  assert "disagree" in str(caught[0].message)   # a RuntimeWarning
  ```

  Args:
    mode: ``"raise"`` (a ``PrimalMismatchError``; under ``jit`` JAX
      surfaces it as its runtime error carrying this message), ``"warn"``
      (a ``RuntimeWarning``) or ``"off"``.
    rtol: relative tolerance, as in ``numpy.allclose``, per output leaf.
    atol: absolute tolerance, as in ``numpy.allclose``, per output leaf.

  Raises:
    ValueError: at once, for an unknown mode or a negative tolerance.
  """

  def __init__(self, mode: str = "raise", rtol: float = 1e-5,
               atol: float = 1e-6):
    """Records the setting; it applies inside ``with`` or a decorated call."""
    if mode not in ("off", "warn", "raise"):
      raise ValueError(f"check_primals mode must be 'off', 'warn' or 'raise', "
                       f"got {mode!r}.")
    if rtol < 0 or atol < 0:
      raise ValueError(f"check_primals tolerances must be >= 0, got "
                       f"rtol={rtol}, atol={atol}.")
    value = "off" if mode == "off" else f"{mode}:{rtol!r}:{atol!r}"
    self._ctx = option(value)

  def __enter__(self):
    """Turns the check on (with this mode and tolerances) until exit."""
    self._ctx.__enter__()
    return self

  def __exit__(self, *exc):
    """Restores the previous setting."""
    return self._ctx.__exit__(*exc)

  def __call__(self, func: Callable) -> Callable:
    """Decorator use: ``func`` runs with the check on.

    Args:
      func: any callable.

    Returns:
      A function that calls ``func`` inside ``with self:``.
    """
    return super().__call__(func)


# the check's "raise" is seen raised: JAX need not also log its traceback
jx.quiet_callback_failures(PrimalMismatchError)


def maybe_check(call, f_outputs: Callable, fwd_outs) -> None:
  """Under remat, ``f``'s primal outputs (``f_outputs()``, run only where
  the check is set) against ``fwd``'s, compared on the host."""
  mode, rtol, atol = _settings()
  if mode == "off":
    return
  names = (call.name, call.rules.rule_name("fwd"))
  _compare(lambda i: (
      f"f ({names[0]}) and fwd ({names[1]}) disagree at primal output leaf "
      f"{i}"), "Under remat the forward pass used f's value and the backward "
      "pass fwd's.", f_outputs(), fwd_outs)


def maybe_check_fused(call, fused_cts, unfused_cts) -> None:
  """``fwd_bwd``'s input cotangents against ``bwd``'s after ``fwd``, leaf
  by leaf where either is nonzero (integer inputs, with no cotangent,
  skipped)."""
  if _settings()[0] == "off":
    return
  pairs = [(i, a, b) for i, (a, b, aval) in enumerate(
               zip(fused_cts, unfused_cts, call.in_avals))
           if aval.to_tangent_aval().dtype != jx.dtypes.float0
           and not (type(a) is type(b) is jx.ad_util.Zero)]
  names = (call.rules.rule_name("fwd_bwd"), call.rules.rule_name("bwd"),
           call.rules.rule_name("fwd"))
  where = [i for i, _, _ in pairs]
  _compare(lambda k: (
      f"fwd_bwd ({names[0]}) and bwd ({names[1]}) after fwd ({names[2]}) "
      f"disagree at the cotangent of input leaf {where[k]} of "
      f"{call.name}"), "Under remat the backward pass used fwd_bwd; without "
      "it, fwd and bwd run, so the gradient depends on jax.checkpoint.",
      [jx.ad.instantiate_zeros(a) for _, a, _ in pairs],
      [jx.ad.instantiate_zeros(b) for _, _, b in pairs])


def _compare(what: Callable, why: str, left, right) -> None:
  """Compares two lists of arrays on the host (``jax.debug.callback``),
  raising or warning as the setting says; ``what(i)`` names leaf ``i``."""
  mode, rtol, atol = _settings()

  def compare(left_vals, right_vals):
    for i, (a, b) in enumerate(zip(left_vals, right_vals)):
      kind = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) \
          else np.float64
      a, b = np.asarray(a, kind), np.asarray(b, kind)
      if not np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
        msg = (f"smartvjp check_primals: {what(i)}: max abs difference "
               f"{np.max(np.abs(a - b)):.3g} (rtol={rtol}, atol={atol}). "
               f"{why}")
        if mode == "raise":
          raise PrimalMismatchError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=1)

  def comparable(x):   # typed PRNG keys compare by their key data
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.key_data(x)
    return x
  jax.debug.callback(compare, [comparable(x) for x in left],
                     [comparable(x) for x in right])
