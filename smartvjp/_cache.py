"""State that lives no longer than a trace. ``jax.custom_vjp`` calls the
rules afresh in every new outer trace, so the caches here keep a traced
rule only for the outermost trace that made it; and the vmap whose
batching rule is running."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import weakref
from typing import Any, Hashable

from smartvjp import _facade as jx


def outermost_trace():
  trace, outer = jx.core.trace_ctx.trace, None
  while trace is not None and not isinstance(trace, jx.core.EvalTrace):
    outer = trace
    trace = getattr(trace, "parent_trace", None)
  return outer


class TraceLocalCache:
  """Entries valid only while the outermost trace that stored them is
  current; nothing cached under plain evaluation."""

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
    """Not stored where ``consts`` hold a tracer (of a nested trace, which
    must not leak)."""
    outer = outermost_trace()
    if outer is None or any(isinstance(c, jx.core.Tracer) for c in consts):
      return
    self._entries[key] = (weakref.ref(outer), value)
    self._entries.move_to_end(key)
    if self.maxsize is not None and len(self._entries) > self.maxsize:
      self._entries.popitem(last=False)


# The vmap (trace tag, axis data) whose batching rule is running: the user's
# rules run again there run as part of that vmap.
_BATCHING: contextvars.ContextVar = contextvars.ContextVar(
    "smartvjp_batching", default=None)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def batching(key):
  return _setting(_BATCHING, key)


def batching_tag(axis_data):
  now = _BATCHING.get()
  return now[0] if now is not None and now[1] is axis_data else None


# The call bound while the current trace differentiates it where it is made
# (its closure error is UnexpectedTracerError there, as jax.custom_vjp's
# leaked tracer; a staged call's is CustomVJPException).
made_where_differentiated: contextvars.ContextVar = contextvars.ContextVar(
    "smartvjp_made_where_differentiated", default=None)


def differentiated_where_made(call):
  return _setting(made_where_differentiated, call)
