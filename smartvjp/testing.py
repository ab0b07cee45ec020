"""Counting how often each rule runs.

:class:`RunCounter` puts a counting step into your rules. The step passes
its arrays through a host callback that counts; like a kernel (Pallas,
Triton, an FFI call) it is one opaque step over all it is given, removed
where nothing reads its outputs and otherwise run whole, and it has no
effect that JAX keeps alive (``jax.debug.callback`` and ``jax.debug.print``
have one, and under ``jax.checkpoint`` JAX then keeps equations it would
otherwise remove, so they change the counts they report). These are the
counts that the README's contract table lists for a removable kernel.

It does change one thing: a JAX-coded rule with a count in it is a kernel
to smartvjp (see :class:`RunCounter`). To see where each rule is placed
without changing anything, read the program: ``smartvjp.print_schedule``.
"""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np

from smartvjp import _facade as jx
from smartvjp import _jaxprs

__all__ = ["RunCounter"]


class RunCounter:
  """Counts the runs of the rules that call :meth:`count`.

  Each call of ``counter.count(name, *arrays)`` inside a rule adds one to
  ``counter.counts[name]`` every time the program runs that step: once per
  execution of a compiled program (``jax.jit``), once per iteration of a
  ``lax.scan``/``while_loop`` body, once per eager evaluation, and once per
  run of a batched rule under ``jax.vmap`` (not once per example). Tracing
  counts nothing.

  ```python
  import jax, jax.numpy as jnp
  from smartvjp import smart_custom_vjp
  from smartvjp.testing import RunCounter

  runs = RunCounter()

  @smart_custom_vjp
  def f(x):
    return runs.count("f", jnp.sin(x))

  def f_fwd(x):
    y, c = runs.count("fwd", jnp.sin(x), jnp.cos(x))
    return y, c

  def f_bwd(c, g):
    return (runs.count("bwd", c * g),)

  f.defvjp(f_fwd, f_bwd)
  loss = lambda x: jnp.sum(jax.checkpoint(f)(x) ** 2)
  jax.block_until_ready(jax.jit(jax.grad(loss))(jnp.ones(3)))
  assert runs.counts == {"f": 1, "fwd": 1, "bwd": 1}
  ```

  **Removed as a kernel is.** Where nothing reads any of the step's
  outputs, JAX's and XLA's dead-code elimination remove it, and the run is
  not counted, as a kernel there would not run (e.g. ``jax.custom_vjp``'s
  ``fwd`` rematerialized under ``save_only_these_names`` when its residual
  is saved: ``fwd 1, bwd 1``). Where one output is read, it runs whole.

  **What it changes: a JAX-coded rule becomes a kernel.** The step is one
  opaque operation over all the rule returns, so smartvjp treats a
  JAX-coded ``fwd`` holding it as a kernel: under a policy that saves part
  of what ``fwd`` computes (``dots_saveable``), it no longer splits
  ``fwd`` (``fwd[part=saved]`` forward and ``fwd[part=rest]`` backward)
  but runs ``f`` forward and ``fwd`` whole backward. The counts are then
  those of an opaque kernel, which is what the counter is for; for the
  schedule of the uncounted rules, use ``smartvjp.print_schedule``, which
  reads the program and changes nothing.

  **``checkpoint_name`` goes after the count**, on the residual the count
  returns: ``z, y = runs.count("fwd", z, y)``, then
  ``checkpoint_name(y, "res")``. A name put before the count is on a value
  the count reads, not on the residual ``fwd`` returns, so
  ``save_only_these_names`` saves nothing.

  Attributes:
    counts: a ``collections.Counter`` ``{name: runs}``; only names that ran
      are keys.
  """

  def __init__(self):
    self.counts: collections.Counter = collections.Counter()

  def count(self, name: str,
            *arrays: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
    """Counts one run of ``name`` and returns ``arrays`` unchanged.

    Put it on what the rule returns (all of it, so that nothing of the
    rule's work can be removed apart from the rest, as with a kernel).

    Args:
      name: the key in :attr:`counts`, e.g. the rule's name.
      *arrays: one or more JAX arrays (any shape, numeric or bool dtype).

    Returns:
      The one array, or a tuple of them for two or more, with the same
      shapes, dtypes and values.

    Raises:
      TypeError: when no array is given, or ``name`` is not a string.
    """
    if not isinstance(name, str):
      raise TypeError(f"RunCounter.count: name must be a string, got "
                      f"{type(name).__name__}")
    if not arrays:
      raise TypeError(f"RunCounter.count({name!r}): give at least one "
                      "array to pass through (the rule's outputs)")
    outs = count_p.bind(*arrays, name=name, counter=self)
    return outs[0] if len(arrays) == 1 else tuple(outs)

  def reset(self) -> None:
    """Sets every count back to zero."""
    self.counts.clear()

  def __repr__(self):
    return f"RunCounter({dict(self.counts)})"


def _run(name, counter, *arrays):
  counter.counts[name] += 1
  return tuple(np.asarray(a) for a in arrays)


count_p = jx.core.Primitive("smartvjp_count")
count_p.multiple_results = True
_jaxprs.register_opaque_kernel(count_p.name)

count_p.def_impl(lambda *arrays, name, counter: list(
    _run(name, counter, *arrays)))
count_p.def_effectful_abstract_eval(
    lambda *avals, name, counter: (list(avals), set()))


def _lower(*arrays, name, counter):
  shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
  # a pure host callback: XLA removes it where nothing reads its outputs, as
  # it removes a kernel's custom call
  return jax.pure_callback(functools.partial(_run, name, counter), shapes,
                           *arrays, vmap_method="sequential")


# not cached per equation (inline answers None: lower by tracing _lower), as
# JAX's own host callbacks are not: one cached lowering shared by two
# equations would send both over one host channel
jx.register_lowering(count_p, _lower, inline=lambda **_: None)
# removed where none of its outputs is read, kept whole where one is: as JAX
# treats a kernel (a pallas_call, an FFI call) with no effects
jx.register_dce(count_p, lambda used, eqn: (
    ([True] * len(eqn.invars), eqn) if any(used)
    else ([False] * len(eqn.invars), None)))
# the identity: tangents pass through, the count stays on the primal values
jx.ad.primitive_jvps[count_p] = lambda primals, tangents, **params: (
    count_p.bind(*primals, **params), list(tangents))
jx.batching.fancy_primitive_batchers[count_p] = (
    lambda axis_data, args, dims, **params: (
        count_p.bind(*args, **params), list(dims)))
