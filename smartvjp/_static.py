"""Cache keys for nondiff values: ``==`` conflates values that trace
differently (``True == 1 == 1.0``, ``0.0 == -0.0``), so builtins key by type
and value, other hashables by identity; unhashable ones get no key."""

from __future__ import annotations

import math
from typing import Any

_SCALARS = (type(None), bool, int, str, bytes, complex)


def static_key(v: Any):
  try:
    hash(v)
  except TypeError:
    return None
  t = type(v)
  if t in _SCALARS:
    return (t, v)
  if t is float:
    return (t, v, math.copysign(1.0, v)) if v == v else (t, "nan")
  if isinstance(v, tuple):    # tuples, namedtuples (lists are unhashable)
    parts = tuple(static_key(e) for e in v)
    return None if any(p is None for p in parts) else (t, parts)
  if hasattr(v, "_smartvjp_static_key"):   # a wrapper that keys itself
    own = v._smartvjp_static_key
    return None if own is None else (t, own)
  return (t, "id", id(v))
