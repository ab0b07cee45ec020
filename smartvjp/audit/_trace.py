"""The audit's tracing: every custom-VJP call a program makes, under each
configuration, with its rules under the audit's named scopes.

While ``recording(config)`` is active, each call of a ``jax.custom_vjp`` or
``smart_custom_vjp`` function (the user's, a library's, one made when the
program runs) is made instead through a *twin* with the same rules, each
wrapped in ``jax.named_scope(tag)``: a name in the equations' name stacks and
in the compiled program's metadata, which changes no equation and nothing
XLA removes or keeps. The configuration says which class the twin is:

* ``as_written``: ``jax.custom_vjp`` with the site's rules (the site's own
  ``optimize_remat``);
* ``optimize_remat``: ``jax.custom_vjp(...).defvjp(..., optimize_remat=True)``;
* ``smartvjp``: ``smart_custom_vjp`` with ``fwd`` and ``bwd``;
* ``smartvjp_fused``: ``smart_custom_vjp`` with ``fwd_bwd`` too, where the
  site has one, forced (``defvjp(..., fused=True)``);
* ``as_is`` (for ``assert_no_duplicate_fwd``): each site with the decorator
  it was made with;
* ``swapped({index: config})`` (for ``measure=True`` and ``Audit.apply``):
  the sites of those indices (a site's index in ``sites``, the same in
  every trace) under their configurations, every other site as
  ``as_written``.

A site written with ``smart_custom_vjp`` is audited as the ``jax.custom_vjp``
it replaces under ``as_written`` (a site given only ``fwd_bwd`` has none:
``None``). JAX's caches are cleared on entry and exit (``jax.clear_caches``),
so that nothing traced outside the block is reused in it, nor the other way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import threading
from typing import Any

import jax

from smartvjp.audit import _count as C
from smartvjp import _facade as jx
from smartvjp import _swap
from smartvjp._api import smart_custom_vjp

CONFIGS = ("as_written", "optimize_remat", "smartvjp", "smartvjp_fused")

_SMART_CALL = smart_custom_vjp.__call__
_VJP3 = jx.custom_vjp3_class()
# each class's own __call__, captured at import: (class, kind, call)
_CLASSES = [(_swap.JAX_CUSTOM_VJP, "jax.custom_vjp", _swap.JAX_CALL),
            (smart_custom_vjp, "smart_custom_vjp", _SMART_CALL)]
if _VJP3 is not None:
  _CLASSES.append((_VJP3, "jax.custom_vjp", _VJP3.__call__))
_ORIGINAL = {cls: call for cls, _, call in _CLASSES}
_LOCK = threading.RLock()
_ACTIVE: list = []      # the recorder of the innermost active block

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # smartvjp/
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))
_SKIP_DIRS = (_HERE + os.sep, _JAX_DIR + os.sep,
              os.path.dirname(contextlib.__file__) + os.sep)


@dataclasses.dataclass
class Call:
  called_at: str
  args: tuple            # dynamic arguments as ShapeDtypeStructs (pytrees)
  static: dict           # position -> nondiff value


@dataclasses.dataclass
class Site:
  """One custom-VJP function the program calls."""
  index: int
  kind: str              # "jax.custom_vjp" or "smart_custom_vjp"
  fun: Any
  fwd: Any
  bwd: Any
  fwd_bwd: Any
  nondiff_argnums: tuple
  symbolic_zeros: bool
  optimize_remat: bool
  generic_batching: Any
  refused: str | None    # why the audit leaves it as it is (no twin)
  calls: list = dataclasses.field(default_factory=list)

  @property
  def name(self) -> str:
    return _swap.qualified(self.fun)

  @property
  def defined_at(self) -> str:
    return where_defined(self.fun)


def where_defined(fn) -> str:
  inner = inspect.unwrap(fn) if callable(fn) else fn
  while isinstance(inner, functools.partial):
    inner = inner.func
  try:
    path = inspect.getsourcefile(inner)
    line = inspect.getsourcelines(inner)[1]
  except (TypeError, OSError):
    return "<unknown>"
  return f"{os.path.abspath(path)}:{line}"


def _called_at() -> str:
  frame = sys._getframe(2)
  while frame is not None:
    path = os.path.abspath(frame.f_code.co_filename)
    if not path.startswith(_SKIP_DIRS) and "<frozen" not in path:
      return f"{path}:{frame.f_lineno}"
    frame = frame.f_back
  return "<unknown>"


def _abstract(x):
  aval = getattr(x, "aval", None)
  if aval is None:
    try:
      aval = jax.typeof(x)
    except TypeError:
      return x
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _scoped(fn, name):
  if fn is None:
    return None

  @functools.wraps(fn)
  def rule(*args, **kwargs):
    with jax.named_scope(name):
      return fn(*args, **kwargs)
  return rule


def swapped(choices: dict, rest: str = "as_written") -> tuple:
  """The configuration under which only the sites ``choices`` names are
  swapped: ``{site index: "smartvjp" or "smartvjp_fused"}`` (each site's
  ``best_config``); every other site as ``rest`` (``"as_written"``, the
  baseline the audit measures from, or ``"as_is"``: as its own decorator
  makes it). Hashable, and the same value for the same choices."""
  unknown = set(choices.values()) - {"smartvjp", "smartvjp_fused"}
  if unknown or rest not in ("as_written", "as_is"):
    raise ValueError(f"a site is swapped to smartvjp or smartvjp_fused, "
                     f"the others as_written or as_is, not "
                     f"{sorted(unknown) or rest}")
  return ("sites", tuple(sorted(choices.items())), rest)


def site_config(config, site: Site) -> tuple[str, bool]:
  """``(the configuration site is traced under, whether a fused rule is
  forced)`` for the recording's ``config``: ``as_is`` and ``swapped``
  resolve per site."""
  if isinstance(config, tuple) and config[0] == "sites":
    own = dict(config[1]).get(site.index)
    if own is None:
      return site_config(config[2], site)
    return own, own == "smartvjp_fused"
  if config == "as_is":   # each site as its own decorator makes it
    return ("as_written" if site.kind == "jax.custom_vjp"
            else "smartvjp_fused"), False
  return config, config == "smartvjp_fused"


class Recorder:
  """The sites found while one configuration is traced."""

  def __init__(self, config: str, sites: dict, wrap=None):
    self.config = config
    # wrap(site, role, rule) -> rule: each twin's scoped rule wrapped once
    # more (``_calibrate``'s capture of the values the rules are given)
    self.wrap = wrap or (lambda site, role, rule: rule)
    self.sites = sites          # id(original) -> Site, shared by configs
    self.calls: dict = {}       # site index -> calls made in this trace
    self.twins: set = set()
    # functions of twins and of sites left as they are: jax.custom_vjp's
    # __call__ under jax_custom_vjp3 (0.12) makes a custom_vjp3 of its fun
    # and calls that, which is the same call, not a new site
    self.funs: set = set()

  def site_of(self, obj, kind) -> Site:
    site = self.sites.get(id(obj))
    if site is None:
      smart = kind == "smart_custom_vjp"
      vjp3 = _VJP3 is not None and isinstance(obj, _VJP3)
      refused = None if smart or vjp3 else _swap.refusal(obj)
      if (smart and obj.fwd is None and obj.fwd_bwd is None) or (
          vjp3 and (obj.fwd is None or obj.bwd is None)):
        refused = "no rules (defvjp was not called)"
      site = Site(index=len(self.sites), kind=kind,
                  fun=obj.f if vjp3 else obj.fun,
                  fwd=getattr(obj, "fwd", None), bwd=getattr(obj, "bwd", None),
                  fwd_bwd=getattr(obj, "fwd_bwd", None),
                  nondiff_argnums=tuple(getattr(
                      obj, "static_argnums" if vjp3 else "nondiff_argnums",
                      ())),
                  symbolic_zeros=bool(getattr(
                      obj, "symz" if vjp3 else "symbolic_zeros", False)),
                  optimize_remat=bool(getattr(
                      obj, "opt_remat" if vjp3 else "optimize_remat", False)),
                  generic_batching=getattr(obj, "generic_batching", None),
                  refused=refused)
      site.original = obj
      self.sites[id(obj)] = site
    return site

  def twin(self, site: Site, call: int):
    if site.refused is not None:
      return None
    config, forced = site_config(self.config, site)
    scoped = lambda fn, role: fn and self.wrap(
        site, role, _scoped(fn, C.tag(site.index, call, role)))
    fun = scoped(site.fun, "f")
    fwd, bwd = scoped(site.fwd, "fwd"), scoped(site.bwd, "bwd")
    if config in ("as_written", "optimize_remat"):
      if site.fwd is None or site.bwd is None:
        return "unavailable"
      twin = _swap.JAX_CUSTOM_VJP(fun, nondiff_argnums=site.nondiff_argnums)
      twin.defvjp(fwd, bwd, symbolic_zeros=site.symbolic_zeros,
                  optimize_remat=(config == "optimize_remat"
                                  or site.optimize_remat))
    else:
      twin = smart_custom_vjp(fun, nondiff_argnums=site.nondiff_argnums)
      fused = site.fwd_bwd is not None and (
          config == "smartvjp_fused" or site.fwd is None)
      twin.defvjp(fwd if site.fwd is not None else None, bwd,
                  symbolic_zeros=site.symbolic_zeros,
                  generic_batching=site.generic_batching or None,
                  fwd_bwd=scoped(site.fwd_bwd, "fwd_bwd")
                  if fused else None,
                  # smartvjp_fused runs the fused pair wherever it can
                  fused=True if fused and site.fwd is not None
                  and forced else None)
    self.twins.add(id(twin))
    self.funs.add(id(fun))
    return twin

  def call(self, original_call, obj, kind, args, kwargs):
    if id(obj) in self.twins or (
        _VJP3 is not None and isinstance(obj, _VJP3) and id(obj.f) in self.funs):
      return original_call(obj, *args, **kwargs)
    site = self.site_of(obj, kind)
    calls = self.calls.setdefault(site.index, [])
    index = len(calls)
    dyn = {i: a for i, a in enumerate(args) if i not in site.nondiff_argnums}
    calls.append(Call(
        called_at=_called_at(),
        args=tuple(jax.tree.map(_abstract, a) for a in dyn.values()),
        static={i: a for i, a in enumerate(args)
                if i in site.nondiff_argnums}))
    twin = self.twin(site, index)
    if twin is None:
      self.funs.add(id(site.fun))
      return original_call(obj, *args, **kwargs)
    if twin == "unavailable":
      site.unavailable = getattr(site, "unavailable", set()) | {
          site_config(self.config, site)[0]}
      return original_call(obj, *args, **kwargs)
    return _ORIGINAL[type(twin)](twin, *args, **kwargs)


def _hook(kind, original):
  def call(self, *args, **kwargs):
    return _ACTIVE[-1].call(original, self, kind, args, kwargs)
  return call


_HOOKS = [(cls, _hook(kind, call)) for cls, kind, call in _CLASSES]


@contextlib.contextmanager
def recording(config: str, sites: dict, wrap=None):
  """Inside the block, custom-VJP calls go through ``config``'s twins
  (``wrap``: see ``Recorder``)."""
  with _LOCK:
    saved = [(cls, cls.__call__) for cls, _ in _HOOKS]
    rec = Recorder(config, sites, wrap)
    _ACTIVE.append(rec)
    for cls, hook in _HOOKS:
      cls.__call__ = hook
    jax.clear_caches()
    try:
      yield rec
    finally:
      _ACTIVE.pop()
      for cls, call in saved:
        cls.__call__ = call
      jax.clear_caches()
