"""``filter_custom_vjp``: ``equinox.filter_custom_vjp``'s API on smartvjp.

Same wrapping as equinox's own (``equinox/_ad.py``): the first argument's
inexact-array leaves are differentiable, everything else is static or
non-differentiable, and the rules always see symbolic zeros. Because equinox
always uses symbolic zeros, JAX's ``optimize_remat`` cannot help equinox users
at all; here the remat behaviour of ``smart_custom_vjp`` applies, and an
optional fused rule can be given with :meth:`filter_custom_vjp.def_fwd_bwd`.

Requires ``equinox`` (the ``examples`` extra, ``pip install -e ".[examples]"``
in the clone, or ``pip install equinox``); it is imported when this class is
first used.
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
  if x is None:   # not an inexact array of vjp_arg: it gets no gradient
    return None
  if ct is None:
    return jnp.zeros(jnp.shape(x), jnp.result_type(x))
  return ct


def _as_array(x):
  """A leaf that was an array (or a tracer) at the call, as an array again.

  Under eager ``jax.grad``/``jax.vjp`` of a Python scalar, JAX hands the rules
  the primal as a Python-number subclass (``TypedFloat``), which equinox's
  ``is_array`` does not count as an array; ``fn_fwd`` would then return a
  Python number where ``fn`` returned an array."""
  return x if isinstance(x, jax.Array) else jnp.asarray(x)   # tracers too


class filter_custom_vjp:
  """``equinox.filter_custom_vjp``'s API with ``smart_custom_vjp``'s remat.

  The first argument ``vjp_arg`` is any pytree (an ``equinox.Module``, a
  tuple, ...): its inexact-array leaves get gradients; its other leaves, and
  everything in ``*args``/``**kwargs``, do not (arrays there must not be
  differentiated). Give the rules with ``def_fwd`` and ``def_bwd``,
  optionally also the fused ``def_fwd_bwd``. Under
  ``equinox.filter_checkpoint``/``jax.checkpoint`` the forward pass runs
  ``fn`` and the backward pass ``fn_fwd`` + ``fn_bwd`` (or ``fn_fwd_bwd``),
  where equinox's own runs ``fn_fwd`` in both. Example (self-contained; it
  needs equinox and runs as written):

  ```python
  import equinox as eqx
  import jax
  import jax.numpy as jnp
  import smartvjp

  class Linear(eqx.Module):
    w: jax.Array

  @smartvjp.filter_custom_vjp
  def apply(layer, x):          # vjp_arg is layer; x gets no gradient
    return jnp.tanh(x @ layer.w)

  @apply.def_fwd
  def apply_fwd(perturbed, layer, x):
    z = jnp.tanh(x @ layer.w)
    return z, z                 # (output, residuals)

  @apply.def_bwd
  def apply_bwd(z, g, perturbed, layer, x):
    return Linear(x.T @ (g * (1 - z ** 2)))   # shaped like layer

  @apply.def_fwd_bwd            # optional: recomputes z, keeps nothing
  def apply_fwd_bwd(g, perturbed, layer, x):
    z = jnp.tanh(x @ layer.w)
    return Linear(x.T @ (g * (1 - z ** 2)))

  layer = Linear(jnp.linspace(0.5, -0.5, 6).reshape(3, 2))
  x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
  loss = lambda layer: jnp.sum(jax.checkpoint(apply)(layer, x) ** 2)
  grads = eqx.filter_grad(loss)(layer)     # a Linear; grads.w is 3 x 2
  ```

  The rules' arguments: ``perturbed`` has ``vjp_arg``'s structure with a
  bool per leaf (is that leaf differentiated?); ``g`` (equinox's
  ``grad_obj``) has the output's structure, with ``None`` for output leaves
  that are not differentiated; ``fn_bwd`` and ``fn_fwd_bwd`` return one
  gradient per leaf of ``vjp_arg``, or ``None`` (no gradient; a value
  returned for a leaf that is not an inexact array is dropped). The rules
  always see symbolic zeros, as equinox's do. See ``smart_custom_vjp`` for
  what runs where and how remat policies decide.

  Args:
    fn: the primal ``fn(vjp_arg, *args, **kwargs)``; any pytree out.

  Raises:
    ImportError: when the wrapper is first called or its rules are given
      and equinox is not installed.
  """

  def __init__(self, fn: Callable):
    """Wraps ``fn(vjp_arg, *args, **kwargs)``; define its rules next."""
    self.fn = fn
    self.fn_fwd: Callable | None = None
    self.fn_bwd: Callable | None = None
    self.fn_fwd_bwd: Callable | None = None
    self.fused: bool | None = None
    self.fn_wrapped = None
    self.__name__ = getattr(fn, "__name__", "fn")
    self.__doc__ = getattr(fn, "__doc__", None)
    self.__wrapped__ = fn

  def def_fwd(self, fn_fwd: Callable) -> Callable:
    """Sets ``fn_fwd(perturbed, vjp_arg, *args, **kwargs) -> (out, res)``.

    ``out`` is what ``fn`` returns for the same arguments; ``res`` (any
    pytree) is handed to ``fn_bwd``. Usable as a decorator; returns
    ``fn_fwd``."""
    self.fn_fwd = fn_fwd
    self._maybe_defvjp()
    return fn_fwd

  def def_bwd(self, fn_bwd: Callable) -> Callable:
    """Sets ``fn_bwd(res, g, perturbed, vjp_arg, *args, **kwargs)``.

    It returns the gradient of ``vjp_arg``: its structure, with ``None`` for
    leaves that get no gradient. Usable as a decorator; returns ``fn_bwd``."""
    self.fn_bwd = fn_bwd
    self._maybe_defvjp()
    return fn_bwd

  def def_fwd_bwd(self, fn_fwd_bwd: Callable | None = None, *,
                  fused: bool | None = None) -> Callable:
    """Sets the optional fused ``fn_fwd_bwd(g, perturbed, vjp_arg, *args,
    **kwargs)``.

    It returns what ``fn_bwd`` returns, recomputing what it needs from the
    arguments instead of reading residuals. Under remat it replaces
    ``fn_fwd`` + ``fn_bwd`` in the backward pass where that costs no more
    (``smart_custom_vjp.defvjp``'s choice); without ``def_fwd`` and
    ``def_bwd`` it is used everywhere. ``fused``: as ``defvjp``'s, ``True``
    or ``False`` forces either pair. Usable as a decorator, also as
    ``@f.def_fwd_bwd(fused=True)``; returns ``fn_fwd_bwd``.

    Raises:
      TypeError: ``fused`` is not ``None``, ``True`` or ``False`` (raised by
        ``defvjp`` once the rules are complete)."""
    if fn_fwd_bwd is None:
      return lambda fn: self.def_fwd_bwd(fn, fused=fused)
    self.fn_fwd_bwd, self.fused = fn_fwd_bwd, fused
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
      diff = jtu.tree_map(lambda x: _as_array(x.value), diff)
      nondiff = jtu.tree_map(lambda x: _as_array(x.value), nondiff)
      arrays = jtu.tree_map(lambda x: _as_array(x.value), arrays)
      vjp_arg = combine(nonarray_vjp_arg, diff, nondiff)
      args, kwargs = combine(nonarray_args_kwargs, arrays)
      return perturbed, vjp_arg, args, kwargs, (diff, nondiff, arrays)

    def grads_out(out, diff):
      if (jtu.tree_structure(out, is_leaf=_is_none)
          != jtu.tree_structure(diff, is_leaf=_is_none)):
        raise RuntimeError(
            f"filter_custom_vjp function {outer.__name__}: the backward rule "
            "returned a gradient whose pytree structure differs from the "
            "first argument's (vjp_arg's) structure, with None allowed at any "
            f"leaf: expected {jtu.tree_structure(diff, is_leaf=_is_none)}, "
            f"got {jtu.tree_structure(out, is_leaf=_is_none)}. Return one "
            "gradient per leaf of vjp_arg, or None where there is none.")
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
                            if self.fn_fwd_bwd is not None else None),
                   fused=self.fused)
    self.fn_wrapped = wrapped

  def __call__(self, vjp_arg: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Evaluates ``fn(vjp_arg, *args, **kwargs)``; derivatives come from the rules.

    Args:
      vjp_arg: any pytree; its inexact-array leaves are differentiable.
      *args: any values; arrays among them are not differentiable.
      **kwargs: the same, by name.

    Returns:
      ``fn``'s output (any pytree; its non-array leaves pass through).

    Raises:
      RuntimeError: when the rules are not defined yet; under
        differentiation, when an array in ``args``/``kwargs`` is
        differentiated (equinox's error), or when ``fn_bwd``'s or
        ``fn_fwd_bwd``'s gradient does not have ``vjp_arg``'s pytree
        structure (``None`` allowed at any leaf).
    """
    if self.fn_wrapped is None:
      raise RuntimeError(
          f"filter_custom_vjp function {self.__name__} was called before its "
          "rules were defined: decorate them with def_fwd and def_bwd (or "
          "def_fwd_bwd) first.")
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
