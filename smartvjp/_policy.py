"""Splitting a transparent ``fwd`` by a remat policy, equation by equation.

When ``fwd`` is JAX code, a remat policy can save some of the values it
computes and not others, exactly as ``jax.checkpoint`` would if ``fwd`` were
inlined into its body. :func:`plan_split` asks JAX's own partial evaluator
to split ``fwd``'s jaxpr that way and decides whether the split is worth it:

* the forward pass runs the part of ``fwd`` that produces the primal outputs
  and the saved values (``known``);
* the backward region rebuilds ``fwd``'s residuals (and the primal outputs,
  which then follow the policy like any other value) from the saved values
  and the call's inputs (``staged``), and runs ``bwd`` on them.

The split is refused (and the whole call recomputed: ``f`` forward, ``fwd``
or ``fwd_bwd`` backward) when it saves nothing that ``fwd`` computes, when an
opaque kernel would run in both passes (saving only some outputs of a kernel
still needs the kernel again), or when what runs in both passes is estimated
to cost more than ``f``, which the whole recomputation runs instead.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from smartvjp import _compat


@dataclasses.dataclass(frozen=True)
class Split:
  """``known``: a spec for ``smartvjp_fwd``, ``[*fwd_consts, *primals] ->
  [*primal_outs, *saved]``; ``staged``: a spec for ``smartvjp_jvp`` whose
  ``fwd`` is ``[*saved, *fwd_consts, *primals] -> [*primal_outs, *new_res]``
  (the saved values are its leading constants)."""
  known: object
  staged: object
  saved_avals: tuple
  # per saved value, the primal output it is (saved as itself), or None
  saved_outputs: tuple = ()


def plan_split(saveable, call, fwd) -> Split | None:
  """The split of ``fwd`` by ``saveable``, or ``None`` to recompute whole."""
  if fwd is None or fwd.jaxpr is None or not fwd.num_new_res:
    return None
  jaxpr = fwd.jaxpr.jaxpr
  n_out = call.num_outs
  known, staged, num_res = _compat.split_by_policy(
      jaxpr, [False] * n_out + [True] * fwd.num_new_res, True, saveable)
  inputs = set(jaxpr.invars)
  computed = [r for r in staged.invars[:num_res] if r not in inputs]
  staged, fillers = _without_saved_outputs(
      staged.replace(invars=[*computed, *jaxpr.invars]), n_out, set(computed))
  _, used = _compat.dce_jaxpr(staged, [True] * len(staged.outvars))
  saved = [r for r, u in zip(computed, used) if u]
  if not saved:
    return None   # nothing fwd computes is kept: f forward is never dearer
  staged, _ = _compat.dce_jaxpr(staged.replace(invars=[*saved, *jaxpr.invars]),
                          [True] * len(staged.outvars), True)
  if len(staged.eqns) == fillers:
    return None   # nothing to recompute: the residuals are simply kept
  outs = list(known.outvars[:n_out])
  saved_outputs = tuple(outs.index(v) if v in outs else None for v in saved)
  extra = [v for v, o in zip(saved, saved_outputs) if o is None]
  known, _ = _compat.dce_jaxpr(known.replace(outvars=[*outs, *extra]),
                         [True] * (n_out + len(extra)), True)
  if not _worth_it(known, staged, call):
    return None
  names = {e.outvars[0]: e.params["name"] for e in jaxpr.eqns
           if e.primitive is _compat.name_p}
  known_spec = dataclasses.replace(
      fwd, jaxpr=_compat.ClosedJaxpr(known, ()),
      new_res_names=tuple(names.get(v) for v in extra), new_res_eqns=())
  staged_spec = fwd.shifted(_compat.ClosedJaxpr(staged, ()), len(saved))
  return Split(known_spec, staged_spec, tuple(v.aval for v in saved),
               saved_outputs)


def _without_saved_outputs(staged, n_out, saved):
  """``(staged, fillers)``: a primal output that the policy saves is read
  from the forward pass,
  not from the backward region: its place among the staged outputs gets a
  zero array (unused, so XLA drops it) instead of the saved value, so that
  the backward region does not keep it alive for nothing."""
  outvars, eqns = list(staged.outvars), list(staged.eqns)
  fillers = 0
  for i in range(n_out):
    if type(outvars[i]) is _compat.Var and outvars[i] in saved:
      aval = outvars[i].aval
      zeros = jax.make_jaxpr(lambda: jnp.zeros(aval.shape, aval.dtype))()
      eqns.extend(zeros.jaxpr.eqns)
      fillers += len(zeros.jaxpr.eqns)
      outvars[i] = zeros.jaxpr.outvars[0]
  return staged.replace(eqns=eqns, outvars=outvars), fillers


def _worth_it(known, staged, call) -> bool:
  """True when what runs in both passes has no opaque kernel and costs no
  more than ``f`` (the alternative runs ``f`` forward and all of ``fwd``
  backward, so the split costs ``fwd + twice``, recomputation ``fwd + f``)."""
  produced = {v for e in known.eqns for v in e.outvars}
  twice = [e for e in staged.eqns if any(v in produced for v in e.outvars)]
  if any(is_opaque(e) for e in twice):
    return False
  return cost(twice) <= cost(call.jaxpr.jaxpr.eqns)


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(x, _compat.ClosedJaxpr):
        yield x.jaxpr
      elif hasattr(x, "eqns") and hasattr(x, "outvars"):
        yield x


def is_opaque(eqn) -> bool:
  """One equation producing several values that JAX cannot look into (a
  ``pallas_call``, a custom call, a callback): part of its outputs costs the
  whole kernel."""
  return (eqn.primitive.multiple_results and len(eqn.outvars) > 1
          and not any(True for _ in _sub_jaxprs(eqn)))


def _size(aval) -> int:
  return math.prod(getattr(aval, "shape", ()))


def cost(eqns) -> float:
  """A rough operation count: matrix products by their multiply-adds, loops
  by their trip count, other operations by their output size, an opaque
  kernel as unbounded."""
  total = 0.0
  for e in eqns:
    subs = list(_sub_jaxprs(e))
    if subs:
      inner = max(cost(j.eqns) for j in subs)
      total += inner * e.params.get("length", 1)
    elif is_opaque(e):
      return math.inf
    elif e.primitive is _compat.name_p:   # checkpoint_name: an identity
      continue
    elif e.primitive.name == "dot_general":
      (lhs_contract, _), _ = e.params["dimension_numbers"]
      k = math.prod(e.invars[0].aval.shape[d] for d in lhs_contract)
      total += 2.0 * _size(e.outvars[0].aval) * k
    else:
      total += sum(_size(v.aval) for v in e.outvars)
  return total
