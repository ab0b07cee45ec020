"""``filter_custom_vjp``: ``equinox.filter_custom_vjp``'s API on smartvjp.

Same wrapping as equinox's own (``equinox/_ad.py``): the first argument's
inexact-array leaves are differentiable, everything else is static or
non-differentiable, and the rules always see symbolic zeros. Because equinox
always uses symbolic zeros, JAX's ``optimize_remat`` cannot help equinox users
at all; here the remat behaviour of ``smart_custom_vjp`` applies, and an
optional fused rule can be given with :meth:`filter_custom_vjp.def_fwd_bwd`.

Requires ``equinox`` (``pip install smartvjp[examples]`` or ``pip install
equinox``); it is imported when this class is first used.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from smartvjp._api import smart_custom_vjp
from smartvjp._static import static_key


def _eqx():
  try:
    import equinox
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("smartvjp.filter_custom_vjp needs equinox: "
                      "pip install equinox") from e
  return equinox


def _is_none(x):
  return x is None


class _Hashable:
  """A static pytree (no arrays) keyed by structure and leaves, so that the
  traced rules are reused across calls with equal static parts."""

  __slots__ = ("tree", "_smartvjp_static_key")

  def __init__(self, tree):
    leaves, treedef = jtu.tree_flatten(tree)
    self.tree = tree
    keys = tuple(static_key(leaf) for leaf in leaves)
    # an unhashable leaf: no key, so the rules are traced at every call
    self._smartvjp_static_key = (
        (treedef, keys) if all(k is not None for k in keys) else None)

  def __hash__(self):
    return hash(self._smartvjp_static_key) if self._smartvjp_static_key \
        is not None else id(self)

  def __eq__(self, other):
    return (isinstance(other, _Hashable)
            and self._smartvjp_static_key == other._smartvjp_static_key)


def _zero_to_none(ct):
  return None if isinstance(ct, jax.custom_derivatives.SymbolicZero) else ct


def _none_to_zero(ct, x):
  if ct is None:
    return None if x is None else jnp.zeros(jnp.shape(x), jnp.result_type(x))
  return ct


class filter_custom_vjp:
  """As ``equinox.filter_custom_vjp``, with smartvjp's remat behaviour.

  Usage (exactly equinox's, plus the optional fused rule)::

    @smartvjp.filter_custom_vjp
    def fn(vjp_arg, *args, **kwargs):
      return out                      # any pytree

    @fn.def_fwd
    def fn_fwd(perturbed, vjp_arg, *args, **kwargs):
      return out, residuals           # residuals: any pytree

    @fn.def_bwd
    def fn_bwd(residuals, grad_obj, perturbed, vjp_arg, *args, **kwargs):
      return grad_vjp_arg             # structure of vjp_arg, None allowed

    @fn.def_fwd_bwd                   # optional
    def fn_fwd_bwd(grad_obj, perturbed, vjp_arg, *args, **kwargs):
      return grad_vjp_arg

  ``perturbed`` has ``vjp_arg``'s structure with a bool per leaf; ``grad_obj``
  has ``None`` for output leaves that were not differentiated. Only
  ``vjp_arg``'s inexact-array leaves get gradients; arrays in ``args`` and
  ``kwargs`` are non-differentiable (as in equinox). Under
  ``equinox.filter_checkpoint``/``jax.checkpoint`` the forward pass runs
  ``fn`` and the backward region ``fn_fwd`` + ``fn_bwd`` (or
  ``fn_fwd_bwd``); see ``smartvjp.smart_custom_vjp`` for the policy rules.

  Raises:
    RuntimeError: when called before ``def_fwd``/``def_bwd`` (or
      ``def_fwd_bwd``), or when ``fn_bwd``'s output structure differs from
      ``equinox.filter(vjp_arg, equinox.is_inexact_array)`` (equinox's
      messages).
  """

  def __init__(self, fn: Callable):
    self.fn = fn
    self.fn_fwd: Callable | None = None
    self.fn_bwd: Callable | None = None
    self.fn_fwd_bwd: Callable | None = None
    self.fn_wrapped = None
    self.__name__ = getattr(fn, "__name__", "fn")
    self.__doc__ = getattr(fn, "__doc__", None)
    self.__wrapped__ = fn

  def def_fwd(self, fn_fwd: Callable) -> Callable:
    self.fn_fwd = fn_fwd
    self._maybe_defvjp()
    return fn_fwd

  def def_bwd(self, fn_bwd: Callable) -> Callable:
    self.fn_bwd = fn_bwd
    self._maybe_defvjp()
    return fn_bwd

  def def_fwd_bwd(self, fn_fwd_bwd: Callable) -> Callable:
    """Optional fused rule ``fn_fwd_bwd(grad_obj, perturbed, vjp_arg, *args,
    **kwargs) -> grad of vjp_arg``: it recomputes what it needs."""
    self.fn_fwd_bwd = fn_fwd_bwd
    self._maybe_defvjp()
    return fn_fwd_bwd

  def _maybe_defvjp(self):
    pair = self.fn_fwd is not None and self.fn_bwd is not None
    if pair or self.fn_fwd_bwd is not None:
      self._defvjp()

  # -- the wrapping (as equinox's) --------------------------------------------

  def _defvjp(self):
    eqx = _eqx()
    combine, partition = eqx.combine, eqx.partition
    is_array, is_inexact = eqx.is_array, eqx.is_inexact_array
    Static = eqx.internal.Static
    outer = self

    def split_out(out):
      array_out, nonarray_out = partition(out, is_array)
      diff_out, nondiff_out = partition(array_out, is_inexact)
      return diff_out, nondiff_out, Static(nonarray_out)

    def unwrap(nonarray_vjp_arg, nonarray_args_kwargs, diff, nondiff, arrays):
      nonarray_vjp_arg = nonarray_vjp_arg.tree
      nonarray_args_kwargs = nonarray_args_kwargs.tree
      perturbed = combine(
          jtu.tree_map(lambda _: False, nonarray_vjp_arg),
          jtu.tree_map(lambda _: False, nondiff),
          jtu.tree_map(lambda x: x.perturbed, diff))
      diff = jtu.tree_map(lambda x: x.value, diff)
      nondiff = jtu.tree_map(lambda x: x.value, nondiff)
      arrays = jtu.tree_map(lambda x: x.value, arrays)
      vjp_arg = combine(nonarray_vjp_arg, diff, nondiff)
      args, kwargs = combine(nonarray_args_kwargs, arrays)
      return perturbed, vjp_arg, args, kwargs, (diff, nondiff, arrays)

    def grads_out(out, diff):
      if (jtu.tree_structure(out, is_leaf=_is_none)
          != jtu.tree_structure(diff, is_leaf=_is_none)):
        raise RuntimeError(
            "custom_vjp gradients must have the same structure as "
            "`equinox.filter(vjp_arg, equinox.is_inexact_array)`, where "
            "`vjp_arg` is the first argument used in the forward pass.")
      out = jtu.tree_map(_none_to_zero, out, diff, is_leaf=_is_none)
      return out, None, None

    def fn_wrapped(nonarray_vjp_arg, nonarray_args_kwargs, diff, nondiff,
                   arrays):
      vjp_arg = combine(nonarray_vjp_arg.tree, diff, nondiff)
      args, kwargs = combine(nonarray_args_kwargs.tree, arrays)
      return split_out(outer.fn(vjp_arg, *args, **kwargs))

    fn_wrapped.__name__ = self.__name__

    def fn_fwd_wrapped(nonarray_vjp_arg, nonarray_args_kwargs, diff, nondiff,
                       arrays):
      perturbed, vjp_arg, args, kwargs, values = unwrap(
          nonarray_vjp_arg, nonarray_args_kwargs, diff, nondiff, arrays)
      out, residuals = outer.fn_fwd(perturbed, vjp_arg, *args, **kwargs)
      array_res, nonarray_res = partition(residuals, is_array)
      return split_out(out), (array_res, Static(nonarray_res), *values,
                              perturbed)

    def fn_bwd_wrapped(nonarray_vjp_arg, nonarray_args_kwargs, residuals,
                       grad_out):
      array_res, nonarray_res, diff, nondiff, arrays, perturbed = residuals
      vjp_arg = combine(nonarray_vjp_arg.tree, diff, nondiff)
      args, kwargs = combine(nonarray_args_kwargs.tree, arrays)
      grad_obj = jtu.tree_map(_zero_to_none, grad_out[0])
      out = outer.fn_bwd(combine(array_res, nonarray_res.value), grad_obj,
                         perturbed, vjp_arg, *args, **kwargs)
      return grads_out(out, diff)

    def fn_fwd_bwd_wrapped(nonarray_vjp_arg, nonarray_args_kwargs, diff,
                           nondiff, arrays, grad_out):
      perturbed, vjp_arg, args, kwargs, (diff_v, _, _) = unwrap(
          nonarray_vjp_arg, nonarray_args_kwargs, diff, nondiff, arrays)
      grad_obj = jtu.tree_map(_zero_to_none, grad_out[0])
      out = outer.fn_fwd_bwd(grad_obj, perturbed, vjp_arg, *args, **kwargs)
      return grads_out(out, diff_v)

    for wrapper, user in ((fn_fwd_wrapped, self.fn_fwd),
                          (fn_bwd_wrapped, self.fn_bwd),
                          (fn_fwd_bwd_wrapped, self.fn_fwd_bwd)):
      wrapper.__name__ = getattr(user, "__name__", wrapper.__name__)

    wrapped = smart_custom_vjp(fn_wrapped, nondiff_argnums=(0, 1))
    have_pair = self.fn_fwd is not None and self.fn_bwd is not None
    wrapped.defvjp(fn_fwd_wrapped if have_pair else None,
                   fn_bwd_wrapped if have_pair else None,
                   symbolic_zeros=True,
                   fwd_bwd=(fn_fwd_bwd_wrapped
                            if self.fn_fwd_bwd is not None else None))
    self.fn_wrapped = wrapped

  def __call__(self, vjp_arg, /, *args: Any, **kwargs: Any):
    if self.fn_wrapped is None:
      raise RuntimeError(
          f"`def_fwd` or `def_bwd` not yet called for {self.__name__}")
    eqx = _eqx()
    combine, partition = eqx.combine, eqx.partition
    array_vjp_arg, nonarray_vjp_arg = partition(vjp_arg, eqx.is_array)
    diff, nondiff = partition(array_vjp_arg, eqx.is_inexact_array)
    arrays, nonarray_args_kwargs = partition((args, kwargs), eqx.is_array)
    arrays = eqx.internal.nondifferentiable(
        arrays, name="`*args` and `**kwargs` to `filter_custom_vjp`")
    diff_out, nondiff_out, nonarray_out = self.fn_wrapped(
        _Hashable(nonarray_vjp_arg), _Hashable(nonarray_args_kwargs), diff,
        nondiff, arrays)
    return combine(diff_out, nondiff_out, nonarray_out.value)
