"""State that lives no longer than a trace: caches of traced rules, and the
vmap whose batching rule is running.

``jax.custom_vjp`` calls the user's ``f``, ``fwd`` and ``bwd`` afresh inside
every new outer trace (a new ``jax.jit``, ``jax.make_jaxpr``, eager
``jax.grad`` or ``jax.vmap``), so Python state they read (a config dict, a
global) is read again each time. smartvjp traces each rule once per abstract
signature to build its primitives; these caches keep a traced rule only for
the outermost trace that made it, so repeated calls inside one program share
it and a new program traces again.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import weakref
from typing import Any, Hashable

from smartvjp import _facade as jx


def outermost_trace():
  """The outermost transformation trace now active, or ``None`` under plain
  evaluation. Each ``jax.jit``/``make_jaxpr``/eager ``grad``/``vmap`` call
  starts a new one; nested traces (scan bodies, linearize inside jit) lead
  back to it through their parents."""
  trace, outer = jx.core.trace_ctx.trace, None
  while trace is not None and not isinstance(trace, jx.core.EvalTrace):
    outer = trace
    trace = getattr(trace, "parent_trace", None)
  return outer


class TraceLocalCache:
  """A mapping (LRU-bounded when ``maxsize`` is given) whose entries are valid
  only while the outermost trace that stored them is the current one; under
  plain evaluation nothing is cached."""

  def __init__(self, maxsize: int | None = None):
    self.maxsize = maxsize
    self._entries: collections.OrderedDict = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._entries)

  def get(self, key: Hashable) -> Any:
    hit = self._entries.get(key)
    if hit is None:
      return None
    owner, value = hit
    outer = outermost_trace()
    if outer is None or owner() is not outer:
      del self._entries[key]   # made by an earlier program: trace again
      return None
    self._entries.move_to_end(key)
    return value

  def put(self, key: Hashable, value: Any, consts=()) -> None:
    """Stores ``value`` unless ``consts`` (the values it closes over) hold a
    tracer: one of a nested trace (a scan body) must not leak into the
    enclosing program."""
    outer = outermost_trace()
    if outer is None or any(isinstance(c, jx.core.Tracer) for c in consts):
      return
    self._entries[key] = (weakref.ref(outer), value)
    self._entries.move_to_end(key)
    if self.maxsize is not None and len(self._entries) > self.maxsize:
      self._entries.popitem(last=False)


# The vmap (trace tag, axis data) whose batching rule for one of smartvjp's
# primitives is running (entered by the primitives' bind on a vmap's trace,
# see _primitive.py): the user's rules, run again by a batching rule, run as
# part of that vmap, so values they close over from it are batched too.
_BATCHING: contextvars.ContextVar = contextvars.ContextVar(
    "smartvjp_batching", default=None)


@contextlib.contextmanager
def batching(key):
  """Notes ``key``, ``(tag, axis_data)`` of a vmap, while its batching rule
  for one of smartvjp's primitives runs."""
  token = _BATCHING.set(key)
  try:
    yield
  finally:
    _BATCHING.reset(token)


def batching_tag(axis_data):
  """The trace tag of the vmap over ``axis_data`` whose batching rule is
  running, else ``None``."""
  now = _BATCHING.get()
  return now[0] if now is not None and now[1] is axis_data else None


# The call being bound by ``smart_custom_vjp.__call__`` while the current
# trace differentiates it where it is made (``jax.grad``, ``jax.vjp`` or
# ``jax.jvp`` applied directly, perhaps through ``vmap``s: ``grad(vmap(F))``,
# ``jacfwd``), or the batched call a ``vmap`` there binds for it: there
# ``jax.custom_vjp`` runs ``fwd`` on a closed-over tracer, which leaks, while a
# staged call (a ``jit``, ``scan`` or ``cond`` body, ``jax.checkpoint``)
# differentiated later is refused by its rule; the two raise different types.
made_where_differentiated: contextvars.ContextVar = contextvars.ContextVar(
    "smartvjp_made_where_differentiated", default=None)


@contextlib.contextmanager
def differentiated_where_made(call):
  """Marks ``call`` as bound directly under a differentiation (see
  above)."""
  token = made_where_differentiated.set(call)
  try:
    yield
  finally:
    made_where_differentiated.reset(token)
