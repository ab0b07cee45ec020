"""smartvjp's primitives, the one call that defines each one's rules, and the
pieces their rules share.

Seven primitives, all with multiple results, each carrying a ``CallSpec``
(``_spec.py``) as its ``call`` param. Each has its rules in one module,
registered at its bottom with :func:`define`:

================= ============ ===================================================
primitive         module       why it is its own primitive
================= ============ ===================================================
``smartvjp_call``   ``_call``    the undifferentiated call: the one equation JAX's
                               transformations meet first, whose JVP, linearize
                               and remat3 rules decide the rest
``smartvjp_primal`` ``_primal``  ``f``'s value where a differentiated call needs only
                               its primal outputs (remat's forward pass), whose
                               derivative is ``fwd``'s code, not the custom rule
``smartvjp_fwd``    ``_fwd``     ``fwd``: partial evaluation places it, and nothing
                               may turn it into ``f`` behind the user's back
``smartvjp_jvp``    ``_jvp``     primal and tangent outputs together: what
                               ``jax.checkpoint`` partially evaluates, so that its
                               rules, not dead-code elimination, place the rules
``smartvjp_lin``    ``_jvp``     the linear map the backward pass transposes: from
                               ``fwd``'s residuals (transpose: ``bwd``) or, with
                               no residuals kept, the primal inputs
                               (transpose: ``fwd_bwd``)
``smartvjp_bwd``    ``_bwd``     ``bwd`` or ``fwd_bwd`` traced when the transpose
                               runs: jaxprs name the rule, higher-order AD and
                               forward mode differentiate or transpose it
``smartvjp_rem``    ``_rem``     remat3's rematerialized side of a call: it carries
                               the decision (what was saved, which ``fwd``
                               rebuilds the rest) until the backward region
                               differentiates it
================= ============ ===================================================
"""

from __future__ import annotations

from typing import Callable

import jax

from smartvjp import _facade as jx
from smartvjp import _vmap

_SmartPrimitive = jx.new_primitive_class(_vmap.batching)

call_p = _SmartPrimitive("smartvjp_call")
primal_p = _SmartPrimitive("smartvjp_primal")
fwd_p = _SmartPrimitive("smartvjp_fwd")
jvp_p = _SmartPrimitive("smartvjp_jvp")
lin_p = _SmartPrimitive("smartvjp_lin")
bwd_p = _SmartPrimitive("smartvjp_bwd")
rem_p = _SmartPrimitive("smartvjp_rem")

# What :func:`define` registered: primitive name -> rule kind -> the function
# as given. design/architecture.md lists the same table, and
# tests/test_architecture.py keeps the two equal.
RULES: dict[str, dict[str, Callable]] = {}

_KINDS = {
    "impl": jx.register_impl,
    "abstract_eval": jx.register_abstract_eval,
    "lowering": jx.register_lowering,
    "jvp": jx.register_jvp,
    "linearization": jx.register_linearization,
    "transpose": jx.register_transpose,
    "partial_eval": jx.register_partial_eval,
    "partial_eval_custom": jx.register_partial_eval_custom,
    "dce": jx.register_dce,
    "batching": jx.register_batching,
    "pp": jx.register_pp,
    "checkify": jx.register_checkify,
    "discharge": jx.register_discharge,
    "remat3": jx.register_remat3,
    "to_lojax": jx.register_to_lojax,
}


def define(prim, *, impl: Callable, bind: Callable | None = None,
           transpose_with_logs=None, **rules: Callable) -> None:
  """Registers every rule of ``prim`` in one call (the ``_facade``
  ``register_*`` function of each kind says the rule's signature).

  Derived unless given: ``lowering`` is ``impl`` (every rule evaluates a
  traced user rule, which lowers by being traced again), ``pp`` is
  :func:`pp_rule`, ``dce`` is :func:`dce_whole`. ``bind``: the primitive's
  own bind (every bind of it, JAX's evaluation of a jaxpr included).
  ``transpose_with_logs``: ``(collecting, merge)`` to also register the
  ``transpose`` rule where JAX's backward pass collects logs (see
  ``_facade.register_transpose_with_logs``). Raises ``TypeError`` for an
  unknown kind of rule and ``ValueError`` for a primitive defined twice.
  """
  unknown = sorted(set(rules) - set(_KINDS))
  if unknown:
    raise TypeError(f"define({prim.name}): unknown rule kinds {unknown}; "
                    f"known: {sorted(_KINDS)}")
  if prim.name in RULES:
    raise ValueError(f"define({prim.name}): already defined")
  rules = {"impl": impl, "lowering": impl, "pp": pp_rule, "dce": dce_whole,
           **rules}
  RULES[prim.name] = dict(rules)
  for kind, rule in rules.items():
    _KINDS[kind](prim, rule)
  if bind is not None:
    prim.bind = bind
  if transpose_with_logs is not None:
    RULES[prim.name]["transpose_with_logs"] = rules["transpose"]
    jx.register_transpose_with_logs(prim, rules["transpose"],
                                    *transpose_with_logs)


# -- what the rules share ----------------------------------------------------------

def eval_scoped(jaxpr, scope: str, args) -> list:
  """Evaluates a traced rule (no constants of its own) under the named scope
  ``scope``, so jaxprs and HLO name the user's rule."""
  with jax.named_scope(scope):
    return jx.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)


def scope(call, rule: str) -> str:
  return f"smartvjp/{call.name}/{rule}"


def dce_whole(used_outputs, eqn):
  """Drops an equation none of whose outputs is used and that has no effect
  JAX keeps; else keeps it whole (JAX's default rule)."""
  if not any(used_outputs) and not jx.effects_keep_alive(eqn.effects):
    return [False] * len(eqn.invars), None
  return [True] * len(eqn.invars), eqn


def pp_rule(eqn, context, settings):
  """Prints an equation with the names of the user's rules it runs instead
  of the spec objects."""
  params = dict(eqn.params)
  call = params.pop("call")
  rules = call.rules
  shown = {"f": call.name}
  fwd = params.pop("fwd", None)
  prim = eqn.primitive
  if prim in (fwd_p, jvp_p, primal_p, rem_p) or (prim is lin_p and fwd):
    if rules.fwd is not None:
      shown["fwd"] = rules.rule_name("fwd")
  if prim in (jvp_p, lin_p) and fwd is not None and rules.bwd is not None:
    shown["bwd"] = rules.rule_name("bwd")
  if (prim is jvp_p or (prim is lin_p and fwd is None)) and \
      rules.fwd_bwd is not None:
    shown["fwd_bwd"] = rules.rule_name("fwd_bwd")
  which = params.pop("which", None)
  if which is not None:
    params.pop("jaxpr")
    shown[which] = rules.rule_name(which)
  if fwd is not None and fwd.num_new_res and prim is not rem_p:
    shown["num_res"] = fwd.num_new_res
  schedule = params.pop("schedule", None)
  if schedule is not None:   # the plan's, as forward=... backward=...
    shown["forward"] = schedule.forward.value
    shown["backward"] = schedule.backward.value
  shown.update((k, v) for k, v in params.items() if v is not None)
  return jx.pp_eqn(jx.eqn_with(eqn, params=shown), context, settings)


def discharged(jaxpr, should, args, positions=None):
  """A traced rule evaluated with its references at the ``should`` positions
  discharged: ``(final value of each such reference or None, outs)``. With
  ``positions``, the rule reads only ``args[i]`` for ``i`` there (the
  primitive's other inputs feed another rule)."""
  if positions is None:
    positions = range(len(args))
  positions = list(positions)
  sub_should = [should[i] for i in positions]
  outs = jx.eval_discharged(jaxpr, sub_should, *[args[i] for i in positions])
  n = len(outs) - sum(sub_should)
  finals = iter(outs[n:])
  new_args = [None] * len(args)
  for i, d in zip(positions, sub_should):
    if d:
      new_args[i] = next(finals)
  return new_args, list(outs[:n])


def rule_jvp(impl, role, primals, tangents, /, *,
             what: str = "higher-order differentiation", **params):
  """JAX's JVP of a rule's code (higher order: grad of grad, hessian), with
  respect to the inputs that move only (as ``jax.custom_vjp`` differentiates
  its rules), so a nested call inside the rule sees its closed-over values
  held fixed. JAX's own exception goes on (an opaque rule's, say), with a
  note naming the rule and ``what`` differentiated it."""
  call = params["call"]
  moving = [type(t) is not jx.Zero for t in tangents]

  def on_moving(*moved):
    it = iter(moved)
    return impl(*[next(it) if m else p for p, m in zip(primals, moving)],
                **params)
  try:
    outs, out_tangents = jax.jvp(
        on_moving, tuple(p for p, m in zip(primals, moving) if m),
        tuple(t for t, m in zip(tangents, moving) if m))
  except Exception as e:  # noqa: BLE001 - JAX's error, with a note added
    e.add_note(
        f"smartvjp: {what} of smart_custom_vjp function {call.name} needs "
        f"the derivative of its {role} rule ({call.rules.rule_name(role)}), "
        "which JAX could not differentiate. Rules that are opaque kernels "
        "support one level of reverse mode; write the rule in differentiable "
        "JAX code, or give it a custom_vjp of its own, for higher orders.")
    raise
  return list(outs), list(out_tangents)


def discharge_by_tracing(impl, name: str):
  """A state discharge rule for a primitive that has no jaxpr of its own
  for all its inputs (forward mode of ``smartvjp_jvp``/``smartvjp_lin``
  under ``jit`` with references): ``impl`` traced with those inputs as
  references, then discharged, as JAX discharges a plain function."""
  def rule(should, *args, **params):
    avals = [jx.ref_aval(jx.get_aval(a)) if d else jx.get_aval(a)
             for a, d in zip(args, should)]
    jaxpr, consts = jx.trace_to_closed_jaxpr(
        lambda *xs: impl(*xs, **params), avals, f"smartvjp {name}", impl,
        avals)
    new_args, outs = discharged(jaxpr, [False] * len(consts) + list(should),
                                [*consts, *args])
    return new_args[len(consts):], outs
  return rule
