"""``swap_report``: whether a program's (or a module's) custom rules are smartvjp's.

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

import functools
import sys
import types
import weakref
from typing import Any, Callable

import jax
import jax.custom_derivatives

from smartvjp import _facade as jx
from smartvjp._api import smart_custom_vjp
from smartvjp._primitive import call_p

__all__ = ["SwapReport", "swap_report"]

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
  empty report). ``str(report)`` is one line per name.
  """

  def __init__(self, entries=(), why=None):
    super().__init__(entries)
    self.why = dict(why or {})

  @property
  def ok(self) -> bool:
    return bool(self) and all(self.values())

  def __str__(self):
    if not self:
      return "no custom_vjp functions found"
    lines = []
    for name, smart in self.items():
      lines.append(f"{'smartvjp' if smart else 'JAX     '}  {name}"
                   + ("" if smart else f": {self.why.get(name, '')}"))
    return "\n".join(lines)


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


def _qualified(fun, name=None) -> str:
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


def _walk(jaxpr, found: dict, why: dict, seen: set):
  for eqn in jaxpr.eqns:
    if eqn.primitive is call_p:
      call = eqn.params["call"]
      found.setdefault(_qualified(call.rules.fun), True)
      if call.jaxpr is not None and id(call.jaxpr) not in seen:
        seen.add(id(call.jaxpr))
        _walk(call.jaxpr.jaxpr, found, why, seen)
      continue
    parts = jx.custom_vjp_call_parts(eqn)
    if parts is not None:
      f_name, bwd = parts
      name = _qualified(bwd, f_name)
      found[name] = False
      why.setdefault(name, _why_jax(getattr(bwd, "__module__", None) or "",
                                    bwd, eqn.params.get("_prim") is not None))
    for sub in jx.jaxprs_in_eqn(eqn):
      if id(sub) not in seen:
        seen.add(id(sub))
        _walk(sub, found, why, seen)


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
  differentiate, not its gradient: once differentiated, a
  ``jax.custom_vjp`` call is inlined into plain equations and can no
  longer be seen.

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
    ``"jax.experimental.pallas.ops.gpu.attention.mha"``. ``report.why``
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
