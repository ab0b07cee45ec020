"""Code you do not own: swapping ``smart_custom_vjp`` in, and reporting on it.

Swapping ``smart_custom_vjp`` into code you do not own.

Kernel and solver libraries (JAX's own Pallas ops among them) decorate their
functions with ``jax.custom_vjp`` when they are imported; a user cannot edit
those files. Two ways in, with different trade-offs, and a way to check:

* ``import_swapped`` loads a *fresh copy* of a module (and, on request,
  of other modules it imports) in which ``jax.custom_vjp`` and
  ``jax.custom_derivatives.custom_vjp`` mean ``smart_custom_vjp``. Nothing
  global is patched, so it works whether or not the module was imported
  already, leaves everyone else's copy alone, covers ``jax.custom_vjp``
  looked up when the copy's functions run (not only at import), and is safe
  with threads.
* ``swap_custom_vjp`` is a context manager that patches the two public
  names for the whole process while it is active: everything that looks them
  up inside the block (a first import, a decorator applied at trace time)
  gets ``smart_custom_vjp``.
* ``swap_report`` says whether a program's custom rules, or a module's,
  are smartvjp's (below).

Only JAX's public names are swapped; JAX's private modules are never touched.

``swap_report``: ``swap_report``: whether a program's (or a module's) custom rules are smartvjp's.

Two questions, two forms:

* ``swap_report(fn, *args, **kwargs)``: traces ``fn`` on the arguments
  (``jax.make_jaxpr``; nothing runs) and finds every custom-VJP call in the
  program, through ``jit``, loops, conditionals, remat and nested calls.
  This is the check to trust: it sees the functions the program really
  calls, wherever they came from (a submodule imported inside a function, a
  module left out of ``include=``, a ``jax.custom_gradient``), and says why
  each one that stays ``jax.custom_vjp``'s does.
* ``swap_report(module)``: an inventory of what a module holds, without
  tracing (a module's code may make more ``custom_vjp`` functions when it
  runs).

Both return a ``SwapReport``: a ``dict`` of ``{name: is_smart}`` with the
reasons in ``why`` and ``ok`` true only when something was found and all of
it is smartvjp's.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.custom_derivatives

from smartvjp import _facade as jx
from smartvjp import _jaxprs
from smartvjp._api import smart_custom_vjp
from smartvjp._primitive import call_p, jvp_p, lin_p, rem_p, rule_p

__all__ = ["SwapError", "SwapReport", "import_swapped", "swap_custom_vjp",
           "swap_report"]


# JAX's class, captured before any swap can be active.
JAX_CUSTOM_VJP = jax.custom_derivatives.custom_vjp
if not isinstance(JAX_CUSTOM_VJP, type) or JAX_CUSTOM_VJP is smart_custom_vjp:
  raise ImportError(
      "smartvjp: jax.custom_derivatives.custom_vjp is not JAX's class at "
      f"import (found {JAX_CUSTOM_VJP!r}); import smartvjp before anything "
      "replaces it")
JAX_MODULES = (jax, jax.custom_derivatives)


# -- what the swaps did, for the reasons a report gives (written by _swap.py) ------

# a jax.custom_vjp function's bwd -> why swap_custom_vjp(existing=True) left
# the function as JAX's when it was called inside the block
REFUSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# modules first imported inside a swap_custom_vjp() block
IMPORTED_IN_BLOCK: set[str] = set()
# the copies import_swapped made (its finders: name, prefixes, created, shared)
COPIES: "weakref.WeakSet" = weakref.WeakSet()


def note_refused(fn, why: str) -> None:
  """Records why ``fn`` (a ``jax.custom_vjp`` function) ran as JAX's."""
  bwd = getattr(fn, "bwd", None)
  try:
    REFUSED[bwd] = why
  except TypeError:   # not weakly referenceable: no reason kept
    pass


def existing_active() -> bool:
  """A ``swap_custom_vjp(existing=True)`` block is active."""
  return getattr(JAX_CUSTOM_VJP.__call__, "_smartvjp_existing", False)


def is_swapped_copy_globals(g) -> bool:
  """``g`` is the namespace of a module that ``import_swapped`` made."""
  b = (g or {}).get("__builtins__")
  return isinstance(b, dict) and getattr(b.get("__import__"),
                                         "_smartvjp_copy", None) is not None

class SwapReport(dict):
  """``{name: is_smart}``, as ``swap_report`` finds them.

  ``why``: for each name whose value is ``False``, why it stays
  ``jax.custom_vjp``'s and what to do about it. ``ok``: something was found
  and all of it is smartvjp's (``all(report.values())`` is also true of an
  empty report). ``str(report)`` tells the three cases apart in its first
  line: every custom rule found is smartvjp's (also in a differentiated
  program, where smartvjp's rules are still seen); some ``jax.custom_vjp``
  calls were not swapped (named, one line each with why); or no custom
  rules were found at all, with a reminder that a ``jax.custom_vjp`` call
  in a program already differentiated by ``jax.grad``/``jax.vjp`` is
  inlined and cannot be seen.
  """

  def __init__(self, entries=(), why=None):
    super().__init__(entries)
    self.why = dict(why or {})

  @property
  def ok(self) -> bool:
    return bool(self) and all(self.values())

  def __str__(self):
    if not self:
      return _NOTHING_FOUND
    jax_names = [name for name, smart in self.items() if not smart]
    lines = [f"not swapped: {len(jax_names)} jax.custom_vjp call(s) "
             f"({', '.join(jax_names)})" if jax_names else
             f"swapped: all {len(self)} custom rule(s) found are smartvjp's"]
    for name, smart in self.items():
      lines.append(f"{'smartvjp' if smart else 'JAX     '}  {name}"
                   + ("" if smart else f": {self.why.get(name, '')}"))
    return "\n".join(lines)


_NOTHING_FOUND = (
    "no custom rules found: nothing here calls a smart_custom_vjp or "
    "jax.custom_vjp function (in a program already differentiated with "
    "jax.grad or jax.vjp a jax.custom_vjp call is inlined and cannot be "
    "seen: pass the function before differentiating it)")


# -- a traced program --------------------------------------------------------------

def _user_fun(fun):
  """The user's function behind one that smartvjp made for it (the ``f``
  of a batched call is a closure over the call it batches)."""
  for _ in range(16):
    inner = fun
    while isinstance(inner, functools.partial):
      inner = inner.func
    if not (getattr(inner, "__module__", None) or "").startswith("smartvjp._"):
      return fun
    for cell in getattr(inner, "__closure__", None) or ():
      try:
        held = cell.cell_contents
      except ValueError:
        continue
      rules = getattr(held, "rules", held)   # a call's spec, or its rules
      if callable(getattr(rules, "fun", None)) and hasattr(rules, "fwd_bwd"):
        fun = rules.fun
        break
    else:
      return fun
  return fun


def qualified(fun, name=None) -> str:
  """``"<module>.<name>"`` of a user's function (``name``: JAX's record of
  it, when ``fun`` is another rule of the same call)."""
  inner = _user_fun(fun)
  while isinstance(inner, functools.partial):
    inner = inner.func
  module = getattr(inner, "__module__", None) or "<unknown module>"
  name = name or getattr(inner, "__name__", None) or repr(inner)
  return f"{module}.{name}"


_WHY_INSIDE_JAX = (
    "made inside JAX (jax.custom_gradient, or another JAX API that builds a "
    "jax.custom_vjp in its private modules, which no swap touches); write "
    "the rule with jax.custom_vjp, or with smart_custom_vjp, to have it "
    "swapped")


def made_inside_jax(fun) -> bool:
  """A custom_vjp function that a JAX API made in JAX's private modules."""
  return jx.is_jax_private_module(getattr(fun, "__module__", None) or "")


_FIX = ("trace the program inside `with smartvjp.swap_custom_vjp("
        "existing=True):`, which reaches every jax.custom_vjp function "
        "however it was made")


def _covering_copy(module_name):
  for copy in list(COPIES):
    if any(module_name == p or module_name.startswith(p + ".")
           for p in copy.prefixes):
      return copy
  return None


def _sharing_copy(module_name):
  """A copy that uses ``module_name`` as the process imported it."""
  for copy in list(COPIES):
    if module_name in copy.shared:
      return copy
    for mod in list(copy.created.values()):
      for value in list(vars(mod).values()):
        if (getattr(value, "__module__", None) == module_name
            or getattr(value, "__name__", None) == module_name):
          return copy
  return None


def _why_jax(module_name: str, bwd_fun, vjp3: bool = False) -> str:
  """Why a ``jax.custom_vjp`` call found in a program is JAX's, and what to do."""
  if jx.is_jax_private_module(module_name):
    return _WHY_INSIDE_JAX
  try:
    refused = REFUSED.get(bwd_fun)
  except TypeError:
    refused = None
  if refused:
    return refused
  if is_swapped_copy_globals(getattr(bwd_fun, "__globals__", None)):
    return ("made in a swapped copy through a name the swap does not cover "
            "(jax.custom_vjp reached through one of JAX's private modules): "
            + _FIX)
  if existing_active():
    if vjp3:
      return ("made while JAX's jax_custom_vjp3 flag was on, which makes "
              "objects of another class on jax 0.10 and 0.11 that the block "
              "does not reach: make it with the flag off, or use "
              "smart_custom_vjp")
    return ("a trace made before this swap_custom_vjp(existing=True) "
            "block: jax.jit (or jax.checkpoint) reused the program it had "
            "cached; trace the function for the first time inside the block")
  copy = _sharing_copy(module_name)
  if copy is not None:
    return (f"not in include=: the copy import_swapped({copy.name!r}) uses "
            f"{module_name} as the process imported it (imported at module "
            f"level or inside a function): add {module_name!r} (or its "
            "package) to include=, or " + _FIX)
  copy = _covering_copy(module_name)
  if copy is not None:
    return (f"the program calls {module_name} as the process imported it, "
            f"not the swapped copy import_swapped({copy.name!r}) made of it "
            "(use the module import_swapped returned wherever the program "
            "reaches it; a copy reaches only what it imports with import "
            "statements, not importlib.import_module): or " + _FIX)
  top = module_name.split(".")[0]
  if module_name in IMPORTED_IN_BLOCK or top in IMPORTED_IN_BLOCK:
    return (f"made when the program ran, after the swap_custom_vjp() block "
            f"in which {module_name} was first imported had ended (its code "
            "calls jax.custom_vjp when it runs, not only at import): " + _FIX)
  return (f"not swapped: {module_name} made it with JAX's jax.custom_vjp and "
          "the program was traced outside `swap_custom_vjp(existing=True)`: "
          + _FIX + " (or copy the library with import_swapped)")


def _behind_jax(fn, depth=3):
  """The function a user wrote behind JAX's wrappers of it (a
  ``WrappedFun``, a partial, a closure made in JAX's private modules)."""
  fn = jx.unwrapped(fn)
  if depth and made_inside_jax(fn):
    for cell in getattr(fn, "__closure__", None) or ():
      try:
        inner = _behind_jax(cell.cell_contents, depth - 1)
      except ValueError:   # an empty cell
        continue
      if callable(inner) and not made_inside_jax(inner):
        return inner
  return fn


def _custom_vjp_call_parts(eqn):
  """For an equation of a ``jax.custom_vjp`` call (``custom_vjp_call``, or
  ``CustomVJPTraced`` under ``jax_custom_vjp3``): ``(f's name as JAX
  recorded it or None, the user's bwd or JAX's wrapper of it)``; else
  ``None``."""
  if eqn.params.get("_prim") is not None:
    parts = jx.custom_vjp3_parts(eqn)
    return None if parts is None else (parts[0], _behind_jax(parts[1]))
  if eqn.primitive.name not in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
    return None
  body = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
  body = getattr(body, "jaxpr", body)
  info = getattr(body, "debug_info", None)
  return (getattr(info, "func_name", None),
          _behind_jax(eqn.params.get("bwd")))


# a call, or what differentiating one leaves (each carries its CallSpec)
_SMART_PRIMITIVES = (call_p, rule_p, jvp_p, lin_p, rem_p)


def _walk(jaxpr, found: dict, why: dict, seen: set):
  for eqn in jaxpr.eqns:
    if eqn.primitive in _SMART_PRIMITIVES:   # differentiated: jvp, lin, ...
      call = eqn.params["call"]
      found.setdefault(qualified(call.rules.fun), True)
      if call.jaxpr is not None and id(call.jaxpr) not in seen:
        seen.add(id(call.jaxpr))
        _walk(call.jaxpr.jaxpr, found, why, seen)
      continue
    parts = _custom_vjp_call_parts(eqn)
    if parts is not None:
      f_name, bwd = parts
      name = qualified(bwd, f_name)
      found[name] = False
      why.setdefault(name, _why_jax(getattr(bwd, "__module__", None) or "",
                                    bwd, eqn.params.get("_prim") is not None))
    for sub in _jaxprs.inner_jaxprs(eqn):   # every branch
      if id(sub.jaxpr) not in seen:
        seen.add(id(sub.jaxpr))
        _walk(sub.jaxpr, found, why, seen)


def _report_program(fn: Callable, args, kwargs) -> SwapReport:
  # a new function each time: never a trace JAX cached under other rules
  closed = jax.make_jaxpr(lambda *a, **k: fn(*a, **k))(*args, **kwargs)
  found, why = {}, {}
  _walk(closed.jaxpr, found, why, set())
  return SwapReport(found, why)


# -- a module's inventory ------------------------------------------------------------

def kind(value) -> bool | None:
  """True: smartvjp's (a smart_custom_vjp function, the class, or a partial
  of it); False: JAX's; None: neither. Looks through ``functools.partial``
  and ``__wrapped__`` (``functools.wraps``, ``jax.jit``)."""
  for _ in range(32):
    if isinstance(value, smart_custom_vjp) or value is smart_custom_vjp:
      return True
    if isinstance(value, JAX_CUSTOM_VJP) or value is JAX_CUSTOM_VJP:
      return False
    if isinstance(value, functools.partial):
      value = value.func
      continue
    if isinstance(value, (types.ModuleType, type)):
      return None
    try:
      value = getattr(value, "__wrapped__", None)
    except Exception:   # noqa: BLE001 -- an object whose attributes raise
      return None
    if value is None:
      return None
  return None


def _real_module(value):
  """A module, or what a swapped view of ``jax`` stands for."""
  return vars(value).get("_smartvjp_real", value)


def entries(module, recurse=True, seen=None):
  """``(key, is_smart, object, what)`` for each custom_vjp thing ``module``
  holds; ``what`` is "function", "decorator" or "runtime" (a function of
  the module that looks ``custom_vjp`` up when it runs)."""
  seen = set() if seen is None else seen
  if id(module) in seen:
    return
  seen.add(id(module))
  prefix = module.__name__
  for attr, value in list(vars(module).items()):
    if attr == "__builtins__":
      continue
    key = f"{prefix}.{attr}"
    if isinstance(value, types.ModuleType):
      # a name bound to jax itself says nothing about what the module's
      # functions make: the functions that look custom_vjp up are reported
      if (recurse and not any(_real_module(value) is m for m in JAX_MODULES)
          and getattr(value, "__name__", "").startswith(prefix + ".")):
        yield from entries(value, recurse, seen)
      continue
    hit = _found(key, value) or _runtime(key, value, module)
    if hit:
      yield hit
      continue
    if isinstance(value, type):
      if value.__module__ != prefix:
        continue
      members = vars(value)
    elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
      continue
    else:
      try:
        members = vars(value)
      except TypeError:
        continue
    for sub, member in list(members.items()):
      if not isinstance(member, types.ModuleType):
        hit = (_found(f"{key}.{sub}", member)
               or _runtime(f"{key}.{sub}", member, module))
        if hit:
          yield hit


def _names_custom_vjp(code, depth=0) -> bool:
  """``code`` (or a function nested in it) reads a name ``custom_vjp``."""
  if "custom_vjp" in code.co_names:
    return True
  return depth < 8 and any(
      isinstance(c, types.CodeType) and _names_custom_vjp(c, depth + 1)
      for c in code.co_consts)


def _runtime(key, value, module):
  """A function of ``module`` whose code looks up ``custom_vjp`` when it
  runs (``jax.custom_vjp(fun)`` in a method, ``from jax import custom_vjp``
  in a decorator factory): it makes a ``custom_vjp`` function each time,
  smartvjp's only in a swapped copy."""
  fn = getattr(value, "__func__", value)   # staticmethod, classmethod
  if not isinstance(fn, types.FunctionType):
    return None
  g = fn.__globals__
  if g is not vars(module) or not _names_custom_vjp(fn.__code__):
    return None
  return key, is_swapped_copy_globals(g), value, "runtime"


def _found(key, value):
  smart = kind(value)
  if smart is None:
    return None
  inner = value
  while isinstance(inner, functools.partial):
    inner = inner.func
  what = ("decorator" if inner is smart_custom_vjp or inner is JAX_CUSTOM_VJP
          else "function")
  return key, smart, value, what


_WHY_IN_MODULE = {
    "function": "a jax.custom_vjp function: the module was not swapped when "
                "it was decorated",
    "decorator": "bound to JAX's decorator: what the module decorates with "
                 "it when its code runs stays jax.custom_vjp's",
    "runtime": "looks up jax.custom_vjp when it runs, and the module is "
               "not a swapped copy: what it makes then is JAX's unless the "
               "program is traced inside `with smartvjp.swap_custom_vjp("
               "existing=True):` (swap_report(fn, *args) says)",
}


def _report_module(module) -> SwapReport:
  found, why = {}, {}
  for key, smart, obj, what in entries(module):
    found[key] = smart
    if not smart:
      why[key] = (_WHY_INSIDE_JAX if what == "function" and made_inside_jax(obj)
                  else _WHY_IN_MODULE[what])
  return SwapReport(found, why)


def swap_report(target: Any, /, *args, **kwargs) -> SwapReport:
  """Whether the custom rules of a program (or a module) are smartvjp's.

  ``swap_report(fn, *args, **kwargs)`` traces ``fn`` on the arguments with
  ``jax.make_jaxpr`` (nothing is evaluated, no kernel runs) and reports every
  custom-VJP call the program makes, found through ``jit``, ``scan``,
  ``cond``, ``while_loop``, ``jax.checkpoint`` and inside other custom
  functions' ``f``: the check to trust after ``import_swapped`` or
  ``swap_custom_vjp``, since it sees the functions the program really calls.
  A ``jax.custom_vjp`` call made only inside another rule's ``fwd`` or
  ``bwd`` is not traced and not reported. Pass the function you
  differentiate (the loss), not its gradient: once differentiated, a
  ``jax.custom_vjp`` call is inlined into plain equations and can no
  longer be seen, so a differentiated program that is not swapped reports
  nothing found. smartvjp's calls are seen in either (a gradient's
  report is ``ok`` where every call is swapped).

  The reasons a call stays ``jax.custom_vjp``'s, each with what to do: a
  ``jax.custom_vjp`` that JAX makes in its private modules
  (``jax.custom_gradient``), which no swap reaches; rules
  ``swap_custom_vjp(existing=True)`` does not take over
  (``defvjp_with_logs``, ``defvjp_with_accums``, ``defremat``); a trace
  cached before the block; a module the swapped copy shares (not in
  ``include=``, or reached through ``importlib``); a ``jax.custom_vjp``
  made when the program ran, after the ``swap_custom_vjp()`` block its
  module was imported in had ended; or a module imported as it is, traced
  outside any swap.

  ``swap_report(module)`` lists, without tracing, the ``custom_vjp``
  functions a module holds: its global names, one level into the classes it
  defines and the other objects it holds (an ``equinox.filter_custom_vjp``
  object's wrapped function), its submodules (for a package), following
  ``functools.partial`` and ``__wrapped__`` (a ``jax.jit`` of one counts);
  names bound to either decorator; and the module's functions and methods
  whose code looks ``custom_vjp`` up when they run (AQT's
  ``DotGeneral.dg_core``, TFP's ``custom_gradient``): ``True`` in a
  swapped copy, ``False`` elsewhere, since what they make is JAX's unless
  the program is traced inside ``swap_custom_vjp(existing=True)``. It
  cannot see ``custom_vjp`` functions that another library makes for the
  module when it runs (optimistix's through equinox): only the program
  form can.

  Args:
    target: a callable (with the positional and keyword arguments to trace
      it on, arrays or ``jax.ShapeDtypeStruct``), or a module object (no
      further arguments), e.g. one returned by ``import_swapped``.

  Returns:
    A ``SwapReport``, a ``dict`` ``{name: is_smart}``: for a program, one
    entry per custom function called, named ``"<module>.<f's name>"``
    (``True``: ``smart_custom_vjp``; ``False``: ``jax.custom_vjp``); for a
    module, dotted names such as
    ``"jax.experimental.pallas.ops.tpu.flash_attention._flash_attention"``.
    ``report.why``
    says, for each ``False`` entry, why and what to do; ``report.ok`` is true
    when the report is not empty and every entry is ``True``.

  Raises:
    TypeError: ``target`` is neither a module nor callable, or a module is
      given with arguments to trace it on. Tracing ``fn`` raises what
      ``jax.make_jaxpr(fn)(*args, **kwargs)`` raises.
  """
  if isinstance(target, types.ModuleType):
    if args or kwargs:
      raise TypeError(f"swap_report: a module ({target.__name__}) is "
                      "reported without tracing; arguments are for a "
                      "function to trace")
    return _report_module(target)
  if not callable(target):
    raise TypeError(f"swap_report: expected a module or a function to trace, "
                    f"got {type(target).__name__} {target!r}")
  return _report_program(target, args, kwargs)


# -- swapping ------------------------------------------------------------------


_JAX = jax
_JAX_CD = jax.custom_derivatives

# Modules that a fresh copy is never made of: ``jax`` itself (its public
# submodules, such as JAX's Pallas ops, are fine), JAX's private modules (a
# name with a component starting with "_"), jaxlib's binaries, the module
# holding the public custom_vjp name, and smartvjp: running them again would
# register primitives and configuration a second time.
_NEVER_FRESH_TREES = ("jaxlib", "jax.custom_derivatives", "smartvjp")


def _never_fresh(name: str) -> str | None:
  """Why ``name`` is never copied, or None."""
  parts = name.split(".")
  if name == "jax":
    return "JAX itself"
  if parts[0] == "jax" and any(p.startswith("_") for p in parts[1:]):
    return "one of JAX's private modules"
  for tree in _NEVER_FRESH_TREES:
    if name == tree or name.startswith(tree + "."):
      return {"jaxlib": "jaxlib", "smartvjp": "smartvjp"}.get(
          tree, "the module holding the public custom_vjp")
  return None


class SwapError(RuntimeError):
  """smartvjp cannot swap ``smart_custom_vjp`` in where it was asked to.

  Raised by ``import_swapped`` when a module cannot be re-executed or
  would keep some ``jax.custom_vjp`` function (the message names each one
  and where it comes from), and by ``swap_custom_vjp`` when the patched
  names were replaced by someone else inside the block.
  """


# -- the process-wide swap -------------------------------------------------------

_patch_lock = threading.RLock()
_patch_depth = 0
_patch_saved: tuple = ()
_calls_depth = 0
JAX_CALL = JAX_CUSTOM_VJP.__call__   # JAX's own, captured at import

# jax.custom_vjp function -> (its fwd, its bwd, the smart_custom_vjp twin
# with those rules): a twin is remade when defvjp gave other rules
_twins: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def refusal(fn) -> str | None:
  """Why ``fn`` (a ``jax.custom_vjp`` function) runs as JAX's inside
  ``swap_custom_vjp(existing=True)``, or None where it runs as smartvjp's."""
  if getattr(fn, "fwd", None) is None or getattr(fn, "bwd", None) is None:
    return "no rules (defvjp was not called)"
  for attr, how in (("with_logs", "defvjp_with_logs"),
                    ("with_accums", "defvjp_with_accums")):
    if getattr(fn, attr, False):
      return (f"its rules were given by {how}, which smartvjp does not take "
              "over from a jax.custom_vjp: decorate it with smart_custom_vjp")
  if getattr(fn, "remat_rules", None) is not None:
    return ("it has defremat rules, which smartvjp does not take over from a "
            "jax.custom_vjp: decorate it with smart_custom_vjp")
  if made_inside_jax(getattr(fn, "fun", None)):
    return _WHY_INSIDE_JAX
  return None


def _twin(fn):
  """The ``smart_custom_vjp`` with ``fn``'s rules (``fn`` a ``jax.custom_vjp``
  function), or ``None`` where ``fn`` is to run as JAX's: no rules yet, rules
  of a kind smartvjp does not take from it (``defvjp_with_logs``,
  ``defvjp_with_accums``, ``defremat``), or made by JAX's own APIs in its
  private modules (``refusal`` says which; ``swap_report`` repeats it)."""
  why = refusal(fn)
  if why is not None:
    note_refused(fn, why)
    return None
  fwd, bwd = fn.fwd, fn.bwd
  cached = _twins.get(fn)
  if cached is not None and cached[0] is fwd and cached[1] is bwd:
    return cached[2]
  twin = smart_custom_vjp(fn.fun, nondiff_argnums=fn.nondiff_argnums)
  twin.defvjp(fwd, bwd, symbolic_zeros=fn.symbolic_zeros,
              generic_batching=getattr(fn, "generic_batching", False) or None)
  _twins[fn] = (fwd, bwd, twin)
  return twin


def _call_as_smart(self, *args, **kwargs):
  """``jax.custom_vjp.__call__`` inside ``swap_custom_vjp(existing=True)``."""
  twin = _twin(self)
  if twin is None:
    return JAX_CALL(self, *args, **kwargs)
  return twin(*args, **kwargs)


_call_as_smart._smartvjp_existing = True   # read by swap_report
_block_modules: set = set()   # sys.modules' names when the outer block began


@contextlib.contextmanager
def swap_custom_vjp(*, existing: bool = False) -> Iterator[None]:
  """Inside the block, ``jax.custom_vjp`` is ``smart_custom_vjp``, process-wide.

  Both public names, ``jax.custom_vjp`` and
  ``jax.custom_derivatives.custom_vjp``, are set to
  ``smartvjp.smart_custom_vjp`` on entry and restored to what they were
  on exit, on an exception too. Typical use: ``import some_kernel_library``
  inside the block, so that its ``@jax.custom_vjp`` decorators (and
  ``functools.partial(jax.custom_vjp, nondiff_argnums=...)``) make
  ``smart_custom_vjp`` functions. Example (self-contained; it runs as
  written):

  ```python
  import jax
  import jax.numpy as jnp
  import smartvjp

  with smartvjp.swap_custom_vjp():
    @jax.custom_vjp               # smart_custom_vjp inside the block
    def f(x):
      return jnp.sin(x)

  f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  assert isinstance(f, smartvjp.smart_custom_vjp)
  assert jax.custom_vjp is not smartvjp.smart_custom_vjp   # restored
  ```

  What it reaches: every lookup of ``jax.custom_vjp`` (or of
  ``jax.custom_derivatives.custom_vjp``, or ``from jax import custom_vjp``)
  that happens while the block is active: the module-level decorators of a
  module imported *for the first time* in the block (and of everything it
  imports for the first time), and ``jax.custom_vjp`` called inside a
  function that runs (or is traced) in the block, as
  ``equinox.filter_custom_vjp`` does when its rules are given. After the
  block, a submodule of a package first imported in it (not of the standard
  library or JAX) that is first imported later, inside a function when it
  runs (tensorcircuit's ``backends/jax_ops.py``), is swapped as it would
  have been in the block: its ``import jax`` gives a view of ``jax`` whose
  ``custom_vjp`` is smartvjp's (as in an ``import_swapped`` copy).

  With ``existing=True`` (the one call for a library you did not write:
  wrap the tracing, or the first call of a ``jax.jit`` function, in the
  block) it also reaches the ``jax.custom_vjp`` functions that exist
  already (decorated before the block, by a module imported
  before it, or one that cannot be imported twice because it registers
  pytree nodes or primitives at import): each call of one inside the block
  runs as a ``smart_custom_vjp`` with the same ``fun``, ``fwd``, ``bwd``,
  ``nondiff_argnums`` and ``symbolic_zeros`` (JAX's class's ``__call__`` is
  patched while the block is active). The objects stay ``jax.custom_vjp``
  functions, and a call outside the block is JAX's again. Left as JAX's:
  functions without rules, rules given by ``defvjp_with_logs``,
  ``defvjp_with_accums`` or ``defremat``, the ``jax.custom_vjp``
  functions JAX's own APIs make (``jax.custom_gradient``), and those
  decorated while JAX's ``jax_custom_vjp3`` flag was on where that makes
  objects of another class (jax 0.10 and 0.11). Entering the outermost
  such block (outside any transformation) clears JAX's caches
  (``jax.clear_caches()``), so that a ``jax.jit`` or ``jax.checkpoint``
  function traced before it (tensorcircuit's ``adaware_svd_jit``) is traced
  again inside, with smartvjp's rules, at the cost of compiling it again.
  A block entered while a transformation traces keeps the caches, and a
  function traced and cached before it keeps JAX's rules there
  (``swap_report`` says so).

  What it does not reach, by construction (without ``existing=True``):

  * functions decorated before the block: they stay ``jax.custom_vjp``
    objects. A module imported before the block is not imported again by an
    ``import`` inside it (Python returns the cached module); use
    ``import_swapped`` for a fresh copy of it, or ``existing=True``;
  * ``jax.custom_vjp`` looked up after the block, e.g. by a function that
    creates its ``custom_vjp`` when it is first traced, if that happens after
    the exit (a function traced and cached by ``jax.jit`` inside the block
    keeps its smartvjp rules when called later);
  * a module that imports ``custom_vjp`` from one of JAX's private modules
    (those are never patched).

  Conversely, what JAX caches by the Python function while the block is
  active outlives it: a program traced after the block that checkpoints the
  same library function (``jax.checkpoint(lib_fn)``, whose trace JAX caches
  by ``lib_fn``) reuses the trace made inside, with smartvjp's rules. To
  compare the two, run each in its own process or call
  ``jax.clear_caches()`` between them.

  Threads: the patch is process-wide, so another thread that looks up
  ``jax.custom_vjp`` while the block is active gets ``smart_custom_vjp``
  too. Blocks in different threads run one at a time: a thread entering
  while another thread's block is active waits for it to end (blocks nest
  freely in one thread; only the outermost exit restores). Where other
  threads import or trace code concurrently, prefer ``import_swapped``,
  which patches nothing global. JAX's own modules reach ``custom_vjp``
  through its private modules, so JAX's internals are unaffected.

  While the block is active ``jax.custom_vjp`` is a different class: an
  ``isinstance(obj, jax.custom_vjp)`` test in the block is a test for
  ``smart_custom_vjp``.

  Check the result with ``swap_report``, or look for smartvjp's
  primitives (names beginning ``smartvjp_``) instead of ``custom_vjp_call``
  in ``jax.make_jaxpr(fn)(*args)``.

  Usable as a decorator too (``@smartvjp.swap_custom_vjp()``).

  Args:
    existing: also run the ``jax.custom_vjp`` functions that exist already
      as ``smart_custom_vjp`` when they are called inside the block.

  Raises:
    SwapError: on exit, when ``jax.custom_vjp`` or
      ``jax.custom_derivatives.custom_vjp`` is no longer
      ``smart_custom_vjp`` (something else replaced it inside the block). The
      names are restored to what they were before the block first, and an
      exception raised in the block is chained to this one.
  """
  global _patch_depth, _patch_saved, _calls_depth
  with _patch_lock:
    if _patch_depth == 0:
      _patch_saved = (_JAX.custom_vjp, _JAX_CD.custom_vjp)
      _block_modules.clear()
      _block_modules.update(sys.modules)
      _JAX.custom_vjp = _JAX_CD.custom_vjp = smart_custom_vjp
    _patch_depth += 1
    if existing:
      if _calls_depth == 0:
        JAX_CUSTOM_VJP.__call__ = _call_as_smart
        if isinstance(jx.core.trace_ctx.trace, jx.core.EvalTrace):
          # a jax.jit (or jax.checkpoint) traced before the block would
          # reuse its trace with JAX's rules: trace again inside
          jax.clear_caches()
      _calls_depth += 1
    try:
      yield
    finally:
      if existing:
        _calls_depth -= 1
        if _calls_depth == 0:
          JAX_CUSTOM_VJP.__call__ = JAX_CALL
      _patch_depth -= 1
      if _patch_depth == 0:
        # for swap_report: what a block imported, whose later run-time
        # custom_vjp lookups get JAX's
        imported = set(sys.modules) - _block_modules
        IMPORTED_IN_BLOCK.update(imported)
        _LATE.reach(imported)
        _block_modules.clear()
        found = {"jax.custom_vjp": _JAX.custom_vjp,
                 "jax.custom_derivatives.custom_vjp": _JAX_CD.custom_vjp}
        _JAX.custom_vjp, _JAX_CD.custom_vjp = _patch_saved
        _patch_saved = ()
        foreign = {k: v for k, v in found.items() if v is not smart_custom_vjp}
        if foreign:
          raise SwapError(
              "swap_custom_vjp: inside the block, " + ", ".join(
                  f"{k} was replaced by {v!r}" for k, v in foreign.items())
              + "; something else patched it while smartvjp's swap was "
              "active, so code in the block may not have had "
              "smart_custom_vjp. The names now hold what they held before "
              "the block.")


# -- fresh, swapped copies of modules -------------------------------------------

class _SwappedModule(types.ModuleType):
  """A stand-in for ``jax`` (or ``jax.custom_derivatives``) inside a swapped
  copy: ``custom_vjp`` is ``smart_custom_vjp``; every other attribute is read
  from (and written to) the real module."""

  def __init__(self, real: types.ModuleType, overrides: dict,
               what: str = "custom_vjp is smart_custom_vjp"):
    super().__init__(real.__name__, real.__doc__)
    own = vars(self)
    for attr in ("__spec__", "__package__", "__loader__", "__file__",
                 "__path__"):
      if hasattr(real, attr):
        own[attr] = getattr(real, attr)
    own.update(overrides)
    own["_smartvjp_real"] = real
    own["_smartvjp_what"] = what

  def __getattr__(self, attr):
    return getattr(vars(self)["_smartvjp_real"], attr)

  def __setattr__(self, attr, value):
    setattr(vars(self)["_smartvjp_real"], attr, value)

  def __delattr__(self, attr):
    delattr(vars(self)["_smartvjp_real"], attr)

  def __dir__(self):
    own = {k for k in vars(self) if not k.startswith("_smartvjp_")}
    return sorted(set(dir(vars(self)["_smartvjp_real"])) | own)

  def __repr__(self):
    return (f"<module {self.__name__!r}, as seen by a module that "
            f"smartvjp.import_swapped loaded: {vars(self)['_smartvjp_what']}>")


_CD_VIEW = _SwappedModule(_JAX_CD, {"custom_vjp": smart_custom_vjp})
_JAX_VIEW = _SwappedModule(_JAX, {"custom_vjp": smart_custom_vjp,
                                  "custom_derivatives": _CD_VIEW})
_VIEWS = {id(_JAX): _JAX_VIEW, id(_JAX_CD): _CD_VIEW}


def _refuse_private_custom_vjp(module, fromlist, globals):
  """``from <module> import custom_vjp`` where ``module`` holds JAX's
  decorator under a name the swap does not cover: a SwapError."""
  if fromlist and "custom_vjp" in fromlist and id(module) not in _VIEWS:
    if getattr(module, "custom_vjp", None) is JAX_CUSTOM_VJP:
      importer = (globals or {}).get("__name__", "a swapped module")
      raise SwapError(
          f"import_swapped: {importer} runs `from {module.__name__} import "
          f"custom_vjp`, which binds JAX's custom_vjp through "
          f"{module.__name__}; only the public names jax.custom_vjp and "
          "jax.custom_derivatives.custom_vjp are swapped (a private module "
          "can change between JAX releases), so this module's custom_vjp "
          "functions would stay jax.custom_vjp. It cannot be swapped without "
          "editing it.")


def _absolute(name, globals, level):
  """The absolute module name an import statement names, or None."""
  if level == 0:
    return name
  package = (globals or {}).get("__package__")
  if not package:
    return None
  try:
    return importlib.util.resolve_name("." * level + name, package)
  except (ImportError, ValueError):
    return None


def _covers(prefixes: tuple[str, ...], name: str) -> bool:
  return any(name == p or name.startswith(p + ".") for p in prefixes)


def _reexecutable(spec) -> bool:
  """Python source or bytecode from a file, or a namespace package: code
  that can run again. Extension modules, built-in and frozen modules
  cannot (or must not) be executed twice; a swapped copy shares them."""
  if spec is None or spec.loader is None:
    return spec is not None and spec.submodule_search_locations is not None
  if isinstance(spec.loader, (importlib.machinery.SourceFileLoader,
                              importlib.machinery.SourcelessFileLoader)):
    return True
  if type(spec.loader).__name__ == "NamespaceLoader":
    return True
  # other file-based loaders with code objects (zip imports, editable
  # installs that load from a source tree)
  return bool(spec.has_location and hasattr(spec.loader, "get_code")
              and hasattr(spec.loader, "exec_module")
              and (spec.origin or "").endswith((".py", ".pyc")))


def _spec_from_others(me, fullname, path, target):
  """The spec the finders after ``me`` on ``sys.meta_path`` give, or None."""
  for finder in sys.meta_path:
    if finder is me or not hasattr(finder, "find_spec"):
      continue
    spec = finder.find_spec(fullname, path, target)
    if spec is not None:
      return spec
  return None


class _SwappedLoader:
  """Wraps a module's loader: executes the module with the copy's
  ``__import__`` in its builtins, and records it as a fresh copy."""

  def __init__(self, loader, finder):
    self._loader, self._finder = loader, finder

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    module.__builtins__ = self._finder.builtins
    self._finder.created[module.__name__] = module
    self._loader.exec_module(module)

  def __getattr__(self, attr):   # get_source, get_code, is_package, ...
    return getattr(self._loader, attr)


class _FreshFinder:
  """One swapped copy: the modules ``prefixes`` cover, made fresh.

  While ``loading()`` is active it is first in ``sys.meta_path``: modules
  that ``prefixes`` cover are found by the finders after it and their
  loaders wrapped, and ``sys.modules`` holds the copy's modules. The
  copy's modules import through ``import_`` (their ``__import__``), at
  import and whenever their functions run later: ``jax`` comes back as a
  view whose ``custom_vjp`` is smartvjp's; a covered module (``from pkg
  import sub`` where ``pkg.sub`` is covered and ``pkg`` is not, or an
  import inside a function that runs after ``import_swapped`` returned) as
  the copy's, made then if it was not yet; any other module as usual."""

  def __init__(self, name, prefixes):
    self.name = name
    self.prefixes = prefixes
    self.builtins = dict(vars(builtins))
    self.builtins["__import__"] = self.import_
    self.created: dict[str, types.ModuleType] = {}
    self.shared: set[str] = set()   # modules outside prefixes it imported
    self._active = 0
    # the copy's functions that look modules up by name -> what runs them
    self.wrappers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

  def __hash__(self):
    return id(self)

  def find_spec(self, fullname, path=None, target=None):
    if not _covers(self.prefixes, fullname):
      return None
    spec = _spec_from_others(self, fullname, path, target)
    if spec is None:
      return None
    if not _reexecutable(spec):
      return spec    # shared: loaded as usual
    if spec.loader is not None:
      spec.loader = _SwappedLoader(spec.loader, self)
    return spec

  @contextlib.contextmanager
  def loading(self):
    """``sys.modules`` and ``sys.meta_path`` set for importing into the
    copy; everything put back afterwards."""
    with _import_lock:
      if self._active:
        self._active += 1
        try:
          yield
        finally:
          self._active -= 1
        return
      # parent packages are shared: imported first, as usual, so that a
      # package whose __init__ imports the module binds the shared module's
      # names, never the copy's
      for p in self.prefixes:
        parent = p.rpartition(".")[0]
        if parent and not _covers(self.prefixes, parent):
          importlib.import_module(parent)
      saved = {n: m for n, m in list(sys.modules.items())
               if _covers(self.prefixes, n)
               and _reexecutable(getattr(m, "__spec__", None))}
      for n in saved:
        del sys.modules[n]
      sys.modules.update(self.created)
      sys.meta_path.insert(0, self)
      self._active = 1
      try:
        yield
      finally:
        self._active = 0
        sys.meta_path.remove(self)
        for n, fresh in self.created.items():
          if sys.modules.get(n) is fresh:
            del sys.modules[n]
        sys.modules.update(saved)
        _restore_parent_attributes(self.created, saved)

  def import_(self, name, globals=None, locals=None, fromlist=(), level=0):
    """``__import__`` of the copy's modules."""
    absolute = _absolute(name, globals, level)
    wanted = [absolute] if absolute else []
    if absolute and fromlist:
      wanted += [f"{absolute}.{x}" for x in fromlist if x != "*"]
    if self._active or not any(_covers(self.prefixes, n) for n in wanted):
      module = self._import(name, globals, locals, fromlist, level)
      # for swap_report: modules the copy uses as the process imported them
      self.shared.update(n for n in wanted if n in sys.modules
                         and not _covers(self.prefixes, n))
      return module
    with self.loading():   # after import_swapped returned: into the copy
      module = self._import(name, globals, locals, fromlist, level)
    self.find_own_modules()
    return module

  def find_own_modules(self) -> None:
    """Each function of the copy (module-level, or a method of a class it
    defines) whose code looks modules up by name when it runs
    (``sys.modules``, ``importlib.import_module``) is replaced, wherever the
    copy's modules hold it, by one that runs it with the copy's modules in
    ``sys.modules`` (as while the copy is imported): a library that finds
    or configures its own modules by name (tensorcircuit's ``set_backend``
    sets ``backend`` on each module named ``tensorcircuit...`` in
    ``sys.modules``) then finds the copy's, and leaves the library as the
    process imported it alone."""
    spaces = {id(vars(m)) for m in self.created.values()}
    own = lambda v: (isinstance(v, types.FunctionType)
                     and id(v.__globals__) in spaces)
    for mod in list(self.created.values()):
      for attr, value in list(vars(mod).items()):
        if own(value) and _looks_modules_up(value.__code__):
          setattr(mod, attr, self._inside(value))
        elif isinstance(value, type) and value.__module__ in self.created:
          for key, member in list(vars(value).items()):
            fn = getattr(member, "__func__", member)
            if own(fn) and _looks_modules_up(fn.__code__):
              inside = self._inside(fn)
              setattr(value, key, inside if fn is member
                      else type(member)(inside))

  def _inside(self, fn):
    wrapped = self.wrappers.get(fn)
    if wrapped is None:
      @functools.wraps(fn)
      def wrapped(*args, **kwargs):
        with self.loading():
          return fn(*args, **kwargs)
      self.wrappers[fn] = wrapped
    return wrapped

  def _import(self, name, globals, locals, fromlist, level):
    module = builtins.__import__(name, globals, locals, fromlist, level)
    _refuse_private_custom_vjp(module, fromlist, globals)
    if fromlist and not _covers(self.prefixes, module.__name__):
      # from pkg import sub, pkg shared: its attribute is the shared sub
      fresh = {x: importlib.import_module(f"{module.__name__}.{x}")
               for x in fromlist if x != "*"
               and _covers(self.prefixes, f"{module.__name__}.{x}")}
      if fresh:
        return _SwappedModule(module, fresh, f"the copy's {', '.join(fresh)}")
    return _VIEWS.get(id(module), module)


_FreshFinder.import_._smartvjp_copy = True   # read by swap_report


class _LateFinder:
  """The submodules, first imported after a ``swap_custom_vjp()`` block, of
  the packages first imported in it (tensorcircuit imports
  ``backends/jax_ops.py`` inside a function, when it first runs): they run
  with an ``__import__`` of their own (as a swapped copy's modules do) that
  hands them ``jax`` as the view whose ``custom_vjp`` is smartvjp's, as the
  block would have. In ``sys.meta_path`` from the first block's exit on;
  finds nothing while a block is active or outside those packages."""

  def __init__(self):
    self.packages: tuple[str, ...] = ()
    self.builtins = dict(vars(builtins))
    self.builtins["__import__"] = self.import_
    self.created: dict[str, types.ModuleType] = {}

  def reach(self, imported) -> None:
    """Covers the packages among ``imported`` (names) whose top-level module
    was imported too: not the standard library, JAX, jaxlib or smartvjp."""
    tops = {n for n in imported if "." not in n
            and n not in sys.stdlib_module_names and not n.startswith("_")
            and n != "jax" and not _never_fresh(n)
            and hasattr(sys.modules.get(n), "__path__")}
    if not tops:
      return
    self.packages = tuple(sorted(set(self.packages) | tops))
    with _import_lock:
      if self not in sys.meta_path:
        sys.meta_path.insert(0, self)

  def find_spec(self, fullname, path=None, target=None):
    if (_patch_depth or fullname in sys.modules
        or not _covers(self.packages, fullname)):
      return None
    spec = _spec_from_others(self, fullname, path, target)
    if spec is None:
      return None
    if _reexecutable(spec) and spec.loader is not None:
      spec.loader = _SwappedLoader(spec.loader, self)
    return spec

  def import_(self, name, globals=None, locals=None, fromlist=(), level=0):
    module = builtins.__import__(name, globals, locals, fromlist, level)
    return _VIEWS.get(id(module), module)


_LATE = _LateFinder()

_import_lock = threading.RLock()


def _looks_modules_up(code) -> bool:
  """``code`` (a function's, with the code nested in it) reads
  ``sys.modules`` or calls ``import_module``."""
  stack = [code]
  while stack:
    c = stack.pop()
    names = set(c.co_names)
    if {"sys", "modules"} <= names or "import_module" in names:
      return True
    stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
  return False


def _check_name(what: str, name) -> str:
  if not isinstance(name, str) or not name or name.startswith(".") or any(
      not part.isidentifier() for part in name.split(".")):
    raise ValueError(f"import_swapped: {what} must be an absolute module name "
                     f"such as 'pkg.module', got {name!r}")
  why = _never_fresh(name)
  if why:
    raise SwapError(
        f"import_swapped: {what} {name!r} is {why}, which smartvjp never "
        "re-executes: a second copy of JAX's core, jaxlib or smartvjp would "
        "register primitives and configuration a second time. Name the "
        "module that calls jax.custom_vjp instead (e.g. "
        "'jax.experimental.pallas.ops.tpu.flash_attention').")
  if name == "__main__":
    raise SwapError("import_swapped: '__main__' is the running script; it "
                    "cannot be imported again. Move the code into a module.")
  return name


def import_swapped(name: str, *, include: Iterable[str] = ()
                   ) -> types.ModuleType:
  """A fresh copy of module ``name`` in which ``jax.custom_vjp`` is smartvjp's.

  The module's code runs again, from its file, with ``jax.custom_vjp`` and
  ``jax.custom_derivatives.custom_vjp`` meaning
  ``smartvjp.smart_custom_vjp``, and the new module object is returned.
  The module already in ``sys.modules`` (if any) and everything that uses it
  are left as they are; nothing global is patched. Example with one of
  JAX's shipped Pallas kernels (self-contained; it runs as written, on a CPU
  too, where it builds the program for a TPU without running it):

  ```python
  import jax
  import jax.numpy as jnp
  import smartvjp

  fa = smartvjp.import_swapped("jax.experimental.pallas.ops.tpu.flash_attention")

  q = jnp.linspace(-1.0, 1.0, 256 * 128).reshape(1, 1, 256, 128)
  attention = lambda q: fa.flash_attention(q, q, q, causal=True)
  assert smartvjp.swap_report(attention, q).ok   # every custom rule it calls
  step = jax.jit(jax.grad(lambda q: jnp.sum(jax.checkpoint(attention)(q) ** 2)))
  lowered = step.trace(q).lower(lowering_platforms=("tpu",))  # no TPU needed
  # under remat: the kernel without the softmax statistics in the forward
  # pass, the one writing them once, in the backward pass (jax.custom_vjp:
  # twice)
  ```

  What is swapped, in the copy's own code: module-level decorators
  (``@jax.custom_vjp``, ``functools.partial(jax.custom_vjp,
  nondiff_argnums=...)``, ``from jax import custom_vjp``, ``import
  jax.custom_derivatives``), and ``jax.custom_vjp`` looked up when a function
  of the copy runs, at any later time. It works by loading the copy through
  a meta-path finder (PEP 451) that gives it an ``__import__`` of its own
  (in its ``__builtins__``, a mechanism ``exec`` documents)
  that hands it, for ``jax`` and ``jax.custom_derivatives``, views of those
  modules whose ``custom_vjp`` is smartvjp's; every other attribute is JAX's
  own.

  Trade-offs, by design:

  * Other modules are shared, not copied, unless ``include`` names them:
    a ``custom_vjp`` function the module imports from a library that is not
    re-executed stays ``jax.custom_vjp`` (this raises, below). ``name``'s own
    submodules (of a package) are always copied, with the package.
  * The copy is a different module object with different functions and
    classes: ``isinstance`` against the shared module's classes fails,
    pickling a function by reference finds the shared module's function,
    and ``jax.jit`` caches are separate. Each call makes a new copy: call it
    once and keep the module.
  * While the copy is executed its modules are in ``sys.modules`` (Python's
    import system needs that, e.g. for dataclasses); the previous entries
    and the parent package's attribute are restored afterwards. Another
    thread that imports one of those modules during the call may get the
    copy; calls of ``import_swapped`` run one at a time.
  * A module the copy imports later, inside a function that runs after
    this call returns, is the copy's where ``name`` or ``include`` covers it
    (made then, in the same way); ``from pkg import sub`` with ``pkg.sub``
    in ``include`` and ``pkg`` shared gets the copy's ``sub``. ``import
    a.b.c`` used as ``a.b.c.fn`` where only ``a.b.c`` is covered gives the
    shared one.
  * A library that finds or configures its own modules by name when it
    runs (tensorcircuit's ``set_backend`` sets ``backend`` on every module
    named ``tensorcircuit...`` in ``sys.modules``): each function of the
    copy (module-level, or a method of a class the copy defines) whose code
    reads ``sys.modules`` or calls ``importlib.import_module`` runs with
    the copy's modules in ``sys.modules``, as while it is imported, so it
    finds the copy's and leaves the library as imported normally alone.
    Such a call takes the import lock, and another thread importing one of
    those modules meanwhile may get the copy's.
  * A library that, when imported, patches another library (tensorcircuit
    replaces methods of ``tensornetwork``'s classes): the copy patches the
    shared library again, so the copy and the library imported normally
    then use whichever patch came last. ``import_swapped`` warns
    (``UserWarning``, naming what was replaced); swap such a library with
    ``swap_custom_vjp()`` around its first import instead.
  * Parent packages are shared and imported first, as usual. A module that
    its package's ``__init__`` imports part-way, and that relies on that
    (reading a submodule from the package before the ``__init__`` rebinds
    the name, as JAX's ``pallas.ops.tpu.megablox.ops`` does), fails in its
    own code when copied alone: copy the package instead.

  Args:
    name: absolute name of the module (e.g.
      ``"jax.experimental.pallas.ops.tpu.flash_attention"``, ``"optax"``). Its
      parent packages are imported as usual (shared).
    include: more module names (each with its submodules) whose fresh,
      swapped copies the copy should use instead of the shared ones: where
      ``name`` imports ``custom_vjp`` functions from another library (the
      ``SwapError`` says which). A library whose ``custom_vjp`` functions are
      made by another library's code at its import, such as diffrax through
      equinox, is better swapped with ``swap_custom_vjp`` around its
      first import: a second copy of equinox beside the first is not
      something that stack supports.

  Returns:
    The new module. ``swap_report(fn, *args)`` of a function that uses it
    says whether every custom rule the program calls is smartvjp's (and
    why not, for each that is not).

  Raises:
    ModuleNotFoundError: ``name`` does not exist (as ``importlib``).
    ValueError: ``name`` or an ``include`` entry is not an absolute module
      name.
    SwapError: the module cannot be swapped: it is JAX's core, jaxlib or
      smartvjp (never re-executed); it has no Python source to run again (an
      extension, built-in or frozen module); it imports ``custom_vjp`` from
      one of JAX's private modules; after loading, the copy still holds
      ``jax.custom_vjp`` functions (the message lists them, each with the
      module it comes from, to add to ``include`` where that helps); or,
      with no ``include``, the copy holds no ``custom_vjp`` function and no
      code that makes one, so it would change nothing (a package whose
      ``__init__`` imports none of its submodules, as ``"aqt"``; a library
      whose ``custom_vjp`` another library makes, as optimistix's through
      equinox): the message names the submodules to copy instead, and
      ``swap_custom_vjp(existing=True)``; where the module re-exports
      names from a submodule outside the copy that makes ``custom_vjp``
      functions (``jaxopt.implicit_diff`` from ``jaxopt._src``), it says so
      and names both fixes: the parent package, or that submodule in
      ``include``.

  An exception that the module's own code raises while it runs propagates
  unchanged.
  """
  _check_name("name", name)
  if isinstance(include, str):
    include = (include,)
  prefixes = (name, *(_check_name("include", n) for n in include))
  finder = _FreshFinder(name, prefixes)
  with finder.loading():
    importlib.import_module(name)
  module = finder.created.get(name)
  if module is None:
    raise SwapError(
        f"import_swapped: {name!r} has no Python source to run again (an "
        "extension, built-in or frozen module); its custom_vjp functions, if "
        "any, cannot be swapped.")
  _check_copy(name, finder.created, include)
  finder.find_own_modules()
  _warn_if_patching_shared(finder)
  COPIES.add(finder)
  return module


def _warn_if_patching_shared(finder) -> None:
  """A warning where the copy set its own functions on the classes or
  modules it shares with the process (tensorcircuit replaces
  ``tensornetwork.Node.__init__`` when imported): the copy and the library
  as imported normally then patch the same objects, and whichever was
  imported last wins for both."""
  spaces = {id(vars(m)) for m in finder.created.values()}
  own = lambda v: (isinstance(getattr(v, "__func__", v), types.FunctionType)
                   and id(getattr(v, "__func__", v).__globals__) in spaces)
  found, seen = [], set()
  for name in sorted(finder.shared):
    module = sys.modules.get(name)
    if module is None:
      continue
    for attr, value in list(vars(module).items()):
      if own(value):
        found.append(f"{name}.{attr}")
      elif isinstance(value, type) and id(value) not in seen:
        seen.add(id(value))
        found += [f"{value.__module__}.{value.__qualname__}.{k}"
                  for k, member in list(vars(value).items()) if own(member)]
  if found:
    warnings.warn(
        f"import_swapped({finder.name!r}): the copy, when imported, replaced "
        f"{', '.join(sorted(set(found))[:4])}"
        f"{' and more' if len(set(found)) > 4 else ''} in a library it shares "
        "with the process; the copy and the library as imported normally "
        "now patch the same objects, and the one imported last wins for "
        "both. Use one of them in a process (or swap the library with "
        "`with smartvjp.swap_custom_vjp(): import ...` instead).",
        UserWarning, stacklevel=3)


def _restore_parent_attributes(created, saved):
  """The import system sets a copy as an attribute of its parent package;
  where the parent is shared, put back what was there."""
  for n, fresh in created.items():
    parent_name, _, child = n.rpartition(".")
    parent = sys.modules.get(parent_name)
    if not parent_name or parent is None or parent_name in created:
      continue
    if getattr(parent, child, None) is not fresh:
      continue
    if n in saved:
      setattr(parent, child, saved[n])
    else:
      try:
        delattr(parent, child)
      except AttributeError:
        pass


def _reexported(created) -> dict[str, list[str]]:
  """``{module outside the copy: [names the copy re-exports from it]}`` for
  the modules of the same library that hold ``custom_vjp`` functions or
  code that makes them (``jaxopt.implicit_diff`` re-exports
  ``jaxopt._src.implicit_diff``)."""
  top = {n.split(".")[0] for n in created}
  found: dict[str, list[str]] = {}
  for mod in created.values():
    for attr, value in list(vars(mod).items()):
      origin = getattr(value, "__module__", None)
      if (attr.startswith("_") or not isinstance(origin, str)
          or origin in created or origin.split(".")[0] not in top):
        continue
      source = sys.modules.get(origin)
      if source is not None and any(entries(source, recurse=False)):
        found.setdefault(origin, []).append(attr)
  return found


def _refuse_reexports(name, created) -> None:
  """A SwapError naming both ways to swap a module whose ``custom_vjp``
  code lives in a submodule it re-exports from, outside the copy."""
  found = _reexported(created)
  if not found:
    return
  origins = sorted(found)
  common = os.path.commonprefix([name.split("."), *(o.split(".")
                                                    for o in origins)])
  parent = ".".join(common) or name.split(".")[0]
  listed = "; ".join(f"{', '.join(sorted(found[o])[:3])} from {o}"
                     for o in origins)
  raise SwapError(
      f"import_swapped({name!r}): the copy holds no custom_vjp function and "
      f"no code that makes one, so it would change nothing: {name} "
      f"re-exports {listed}, which the copy shares unswapped (outside it, "
      "their jax.custom_vjp stays JAX's). Either copy the package that "
      f"holds both, import_swapped({parent!r}), or copy what it re-exports "
      f"with it, import_swapped({name!r}, include={tuple(origins)!r}).")


def _check_copy(name, created, include):
  """Raises SwapError if a module of the copy holds jax.custom_vjp functions
  or JAX's decorator itself. A ``jax.custom_vjp`` that a JAX API builds in
  JAX's private modules (``jax.custom_gradient``) is left as it is, as no
  swap reaches those modules: ``swap_report`` lists it and says so."""
  problems = []
  for mod in created.values():
    for key, smart, obj, what in entries(mod, recurse=False):
      if smart:
        continue
      origin = getattr(obj, "__module__", None)
      if what == "function" and made_inside_jax(obj):
        continue
      if what == "function" and origin and origin not in created:
        problems.append(f"{key} (made in {origin}, which the copy shares: "
                        f"add {origin!r} to include=)")
      else:
        problems.append(f"{key} (made in the copy through a name the swap "
                        "does not cover, such as one of JAX's private modules)")
  if problems:
    raise SwapError(
        f"import_swapped({name!r}): the copy still holds jax.custom_vjp "
        f"where smart_custom_vjp was asked for: {'; '.join(problems)}.")
  if not include and not any(smart for mod in created.values()
             for _, smart, _, _ in entries(mod, recurse=False)):
    _refuse_reexports(name, created)
    subs = sorted(n for n in sys.modules if n.startswith(name + "."))
    raise SwapError(
        f"import_swapped({name!r}): the copy holds no custom_vjp function "
        "and no code that makes one, so it would change nothing"
        + (f" (its package imports none of the submodules that define "
           f"them, such as {', '.join(subs[:3])}: copy one of those, with "
           f"include=({name!r},))" if subs else "")
        + ". Where a library makes its custom_vjp functions in another "
        "library's code when it runs (optimistix's through equinox), or "
        "imports them lazily, trace the program inside `with "
        "smartvjp.swap_custom_vjp(existing=True):` instead; swap_report(fn, "
        "*args) says whether a program's rules are smartvjp's.")
