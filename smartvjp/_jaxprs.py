"""Reading jaxprs before anything compiles: the one opaque-kernel definition
and the one sub-jaxpr walker (:func:`inner_jaxprs`, which every descent
into an equation's jaxprs goes through; it does not enter a kernel), and
what equations amount to. A ``cond``'s branches are read three ways, named
here only: the **costliest branch** for a price (:func:`fold`; the audit's
loop correction by flops + bytes, its counts key by key), the **sum of
branches** for a tally (:func:`equations`, each branch as if it ran), and
**every branch** for a search (``_schedule.rule_equations``, ``_swap``'s
walk, :func:`unjustified_invariance`'s axis names)."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

from smartvjp import _facade as jx
from smartvjp import _plan

# what a collective and an opaque kernel (code no cost estimate or jaxpr
# walk sees into) are called in a jaxpr
COLLECTIVE_PRIMITIVES = frozenset({
    "psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute",
    "psum_scatter", "reduce_scatter", "pbroadcast", "psum_invariant",
    "all_gather_invariant"})
# mpmd_map: a Mosaic GPU kernel (plgpu.kernel, e.g. JAX's attention_mgpu) on
# jax 0.10.2 through 0.12.1 (tests/test_attention_mgpu.py)
KERNEL_PRIMITIVES = frozenset({
    "pallas_call", "mpmd_map", "custom_call", "ffi_call", "pure_callback",
    "io_callback", "callback", "triton_kernel_call", "tpu_custom_call"})
_MORE_KERNELS: set = set()            # register_opaque_kernel's
_INNER: dict = {}                     # register_inner_jaxprs's


def register_opaque_kernel(name: str) -> None:
  """Counts primitive ``name`` as an opaque kernel (``is_opaque_kernel``):
  for a primitive defined outside JAX whose work no walk sees into (the
  tests' kernel, ``RunCounter``'s step)."""
  _MORE_KERNELS.add(name)


def is_opaque_kernel(eqn) -> bool:
  """The one definition of an opaque kernel: an equation whose work no
  jaxpr walk or cost analysis before compiling sees into (a Pallas kernel,
  a custom or FFI call, a host callback, or a registered primitive). Read
  by the plan, ``print_schedule``, ``swap_report`` and the audit."""
  return is_opaque_kernel_name(eqn.primitive.name)


def is_opaque_kernel_name(name: str) -> bool:
  """``is_opaque_kernel`` by primitive name (what ends a compiled
  instruction's ``op_name``: the audit's compiled counts)."""
  return name in KERNEL_PRIMITIVES or name in _MORE_KERNELS


def is_multi_output_kernel(eqn) -> bool:
  """An opaque kernel with several outputs: running it for part of them
  costs the whole kernel (so a policy's split never runs it twice)."""
  return is_opaque_kernel(eqn) and len(eqn.outvars) > 1


def kernel_cost_estimate(eqn) -> dict | None:
  """The one reader of a kernel's own cost estimate (a ``pallas_call``'s
  ``cost_estimate``): ``{"flops", "transcendentals", "bytes_accessed"}``
  per launch, or ``None`` where the kernel states none."""
  est = eqn.params.get("cost_estimate") if is_opaque_kernel(eqn) else None
  if est is None:
    return None
  return {k: float(getattr(est, k, 0) or 0)
          for k in ("flops", "transcendentals", "bytes_accessed")}


def register_inner_jaxprs(prim, fn: Callable) -> None:
  """``fn(**params) -> [Jaxpr]``: the jaxprs an equation of ``prim`` runs
  once each (for primitives whose bodies are not plain params: smartvjp's
  own, which hold them in a ``CallSpec``)."""
  _INNER[prim] = fn


class Inner(NamedTuple):
  """One jaxpr an equation runs: ``kind`` ``"inline"`` (once per run of
  the equation), ``"loop"`` (``trips`` times: a ``scan``'s ``length``,
  ``None`` for a ``while``; ``unroll`` copies per compiled iteration) or
  ``"branch"`` (one of the equation's branches runs: see the module's
  three readings)."""
  jaxpr: Any
  kind: str
  trips: int | None = 1
  unroll: int = 1


def _as_jaxpr(v):
  if isinstance(v, jx.ClosedJaxpr):
    return v.jaxpr
  return v if isinstance(v, jx.core.Jaxpr) else None


def inner_jaxprs(eqn, into_kernels: bool = False) -> list[Inner]:
  """The one sub-jaxpr walker: the jaxprs ``eqn`` (a ``JaxprEqn``) runs,
  each an :class:`Inner` (``jaxpr``: a ``Jaxpr``, never closed; ``kind``,
  ``trips``, ``unroll``), ``[]`` for an equation that runs none. Covers
  ``jit``/``pjit``/``closed_call``, ``custom_jvp``/``custom_vjp`` calls
  (their primal body), ``cond`` branches (``kind="branch"``, one per
  branch), ``scan``/``while`` bodies (``kind="loop"``; a ``while``'s body
  then its condition), ``shard_map``, a checkpoint, smartvjp's own
  primitives (``register_inner_jaxprs``), and under
  ``jax_remat3``/``jax_custom_vjp3`` a high-level primitive's own jaxpr
  (``_prim``). An opaque kernel's own body (a ``pallas_call``'s) is the
  kernel, not walked, unless ``into_kernels`` (then ``"inline"``: a search
  for names, not a price).

  A recursive reader is ``for sub in inner_jaxprs(eqn): read(sub.jaxpr)``,
  scaling by ``sub.trips`` (``None``: unknown) where it counts, and
  choosing one of the module's three readings where ``sub.kind ==
  "branch"``."""
  if is_opaque_kernel(eqn) and not into_kernels:
    return []
  name, params = eqn.primitive.name, eqn.params
  if eqn.primitive in _INNER:
    return [Inner(j, "inline") for j in _INNER[eqn.primitive](**params)]
  if name == "scan":
    n, unroll = params["length"], params.get("unroll", 1)
    unroll = n if unroll is True else max(min(int(unroll), n), 1)
    return [Inner(params["jaxpr"].jaxpr, "loop", n, unroll)]
  if name == "while":
    return [Inner(params["body_jaxpr"].jaxpr, "loop", None),
            Inner(params["cond_jaxpr"].jaxpr, "loop", None)]
  if name == "cond":
    return [Inner(b.jaxpr, "branch") for b in params["branches"]]
  values = list(params.values()) + jx.high_level_jaxprs(eqn)
  out, seen = [], set()
  for value in values:
    for v in value if isinstance(value, (tuple, list)) else (value,):
      j = _as_jaxpr(v)
      if j is not None and id(j) not in seen:
        seen.add(id(j))
        out.append(Inner(j, "inline"))
  return out


def equations(jaxpr, trips: int | None = 1):
  """``(eqn, trips)`` for every equation of ``jaxpr`` (a ``Jaxpr`` or
  ``ClosedJaxpr``) at any depth (``inner_jaxprs``), with how many times it
  runs per run of ``jaxpr`` (``None`` inside a ``while``; branches: the
  sum of branches, each as if it ran)."""
  jaxpr = _as_jaxpr(jaxpr) or jaxpr
  for eqn in jaxpr.eqns:
    yield eqn, trips
    for sub in inner_jaxprs(eqn):
      inner = (None if trips is None or sub.trips is None
               else trips * sub.trips)
      yield from equations(sub.jaxpr, inner)


def fold(jaxpr, per_eqn: Callable[[Any], dict]) -> dict:
  """``per_eqn``'s figures (a dict of numbers) summed over ``jaxpr``'s
  equations (``jaxpr``: a ``Jaxpr``, a ``ClosedJaxpr`` or a list of
  equations) at any depth, each times its runs: a loop's body times its
  trip count (a ``while``'s once), of a ``cond`` the costliest branch
  (the largest sum of figures)."""
  eqns = jaxpr if isinstance(jaxpr, list) else (_as_jaxpr(jaxpr) or jaxpr).eqns
  total: dict = {}

  def add(d, n=1):
    for k, v in d.items():
      total[k] = total.get(k, 0) + n * v
  for eqn in eqns:
    add(per_eqn(eqn))
    subs = inner_jaxprs(eqn)
    branches = [fold(s.jaxpr, per_eqn) for s in subs if s.kind == "branch"]
    if branches:
      add(max(branches, key=lambda d: sum(d.values())))
    for s in subs:
      if s.kind != "branch":
        add(fold(s.jaxpr, per_eqn), s.trips or 1)
  return total


def kernel_totals(jaxpr) -> dict:
  """What a jaxpr's opaque kernels and collectives amount to per run
  (``fold``): ``kernels`` (launches), ``collectives``, ``without_estimate``
  (launches of kernels stating no cost), and the kernels' own estimates
  summed (``kernel_cost_estimate``: ``flops``, ``transcendentals``,
  ``bytes_accessed``). The plan's and the audit's price of a kernel."""
  def per_eqn(eqn):
    if eqn.primitive.name in COLLECTIVE_PRIMITIVES:
      return {"collectives": 1}
    if not is_opaque_kernel(eqn):
      return {}
    est = kernel_cost_estimate(eqn)
    return dict(est or {"without_estimate": 1}, kernels=1)
  out = dict.fromkeys(("kernels", "collectives", "without_estimate", "flops",
                       "transcendentals", "bytes_accessed"), 0)
  out.update(fold(jaxpr, per_eqn))
  return out


def _size(aval) -> int:
  return math.prod(getattr(aval, "shape", ()))


def _operations(eqn) -> dict:
  if is_multi_output_kernel(eqn):
    return {"ops": math.inf}
  if (inner_jaxprs(eqn)
      or jx.checkpoint_name_of(eqn.primitive, eqn.params) is not None):
    return {}   # counted in its jaxprs; checkpoint_name: an identity
  if eqn.primitive.name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    k = math.prod(eqn.invars[0].aval.shape[d] for d in lhs_contract)
    return {"ops": 2.0 * _size(eqn.outvars[0].aval) * k}
  return {"ops": sum(_size(v.aval) for v in eqn.outvars)}


def operation_count(jaxpr) -> float:
  """A rough operation count of ``jaxpr`` (as :func:`fold` takes it):
  a ``dot_general`` its multiply-adds, any other equation its outputs'
  elements; a multi-output kernel is unbounded (``math.inf``); loops per
  trip (a ``while``'s body once), a ``cond``'s costliest branch."""
  return float(fold(jaxpr, _operations).get("ops", 0.0))


def plan_cost(jaxpr) -> _plan.Cost:
  """The plan's price of a traced rule (``jaxpr``: closed), before
  compiling (the audit's ``rule_cost`` prices compiled rules): the Pallas
  cost estimate of its JAX-coded operations plus its kernels' own
  estimates, its collectives and opaque kernels (``kernel_totals``), the
  kernels' estimated bytes, and the bytes of its outputs."""
  try:
    est = jx.pallas_cost.cost_estimate_jaxpr(jaxpr)
    flops = float(est.flops + est.transcendentals)
  except Exception:  # noqa: BLE001 - a primitive it has no rule for
    flops = 0.0
  k = kernel_totals(jaxpr)
  written = sum(_size(a) * getattr(getattr(a, "dtype", None), "itemsize", 0)
                for a in jaxpr.out_avals)
  return _plan.Cost(int(k["collectives"]),
                    flops + k["flops"] + k["transcendentals"],
                    int(k["kernels"]), written, k["bytes_accessed"])


# -- manual axes (shard_map) ------------------------------------------------------

def _varying_axes(aval) -> frozenset:
  """The manual mesh axes (``jax.shard_map`` with ``check_vma=True``) along
  which values of type ``aval`` vary; empty outside such a ``shard_map``."""
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", ()))


def _axis_names_in(eqn, out: set) -> None:
  """Every string in ``eqn``'s params (in tuples and sets too) and in
  those of the equations it runs (every branch, a kernel's body too): the
  axis names it may act over."""
  def strings(value):
    if isinstance(value, str):
      out.add(value)
    elif isinstance(value, (tuple, list, frozenset, set)):
      for v in value:
        strings(v)
  for value in eqn.params.values():
    strings(value)
  for sub in inner_jaxprs(eqn, into_kernels=True):
    for inner in sub.jaxpr.eqns:
      _axis_names_in(inner, out)


def unjustified_invariance(jaxpr) -> list:
  """Per output, the manual mesh axes its type is invariant along although
  its inputs vary along them and no collective over them produced it (a
  ``pure_callback``'s result inside ``shard_map(check_vma=True)``)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  honest = {}

  def get(v):
    if type(v) is not jx.core.Var:
      return frozenset()
    return honest.get(v, _varying_axes(v.aval))

  for eqn in jaxpr.eqns:
    inputs = frozenset().union(*(get(v) for v in eqn.invars))
    named: set = set()
    _axis_names_in(eqn, named)
    for v in eqn.outvars:
      honest[v] = _varying_axes(v.aval) | (inputs - named)
  return [get(v) - (_varying_axes(v.aval)
                    if type(v) is jx.core.Var else frozenset())
          for v in jaxpr.outvars]
