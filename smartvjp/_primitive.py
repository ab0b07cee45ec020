"""smartvjp's five primitives (``design/architecture.md`` says why each
exists), each made by :func:`define`, which derives the generic rules from
what the primitive evaluates (a :class:`Code`); the rules specific to one
transformation are registered in its module with :func:`register`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax import tree_util

from smartvjp import _cache
from smartvjp import _facade as jx
from smartvjp import _jaxprs
from smartvjp._checks import ROLE_NAMES


class _SmartPrimitive(jx.core.Primitive):
  """A multiple-results primitive whose binds on a vmap's trace run inside
  that vmap's ``_cache.batching`` context (the user's rules, run again by a
  batching rule, see values they close over from that vmap as batched)."""
  multiple_results = True

  def bind_with_trace(self, trace, args, avals, params, /):
    if not isinstance(trace, jx.batching.BatchTrace):
      return super().bind_with_trace(trace, args, avals, params)
    with _cache.batching((trace.tag, trace.axis_data)):
      return super().bind_with_trace(trace, args, avals, params)


# What define() and register() registered: primitive name -> kind -> function.
# design/architecture.md lists the same table (tests/test_architecture.py).
RULES: dict[str, dict[str, Callable]] = {}


def _entry(table):
  return lambda prim, fn: table.__setitem__(prim, fn)


# how each kind of rule is registered: an entry in JAX's table, or through
# the facade's adapter where JAX's releases differ in its form
_KINDS = {
    "impl": lambda prim, fn: prim.def_impl(fn),
    "abstract_eval": lambda prim, fn: prim.def_effectful_abstract_eval(fn),
    "lowering": jx.register_lowering,
    "jvp": _entry(jx.ad.primitive_jvps),
    "linearization": jx.register_linearization,
    "transpose": _entry(jx.ad.primitive_transposes),
    "partial_eval": _entry(jx.pe.custom_partial_eval_rules),
    "partial_eval_custom": _entry(jx.pe.partial_eval_jaxpr_custom_rules),
    "dce": jx.register_dce,
    "batching": _entry(jx.batching.fancy_primitive_batchers),
    "pp": _entry(jx.core.pp_eqn_rules),
    "checkify": jx.register_checkify,
    "discharge": jx.register_discharge,
    # what Pallas' cost estimate counts for an equation (pl.estimate_cost)
    "pallas_cost": jx.pallas_cost.register_cost_rule,
    "remat3": jx.register_remat3,
    # how JAX evaluates prim where it needs low-level primitives only (a
    # jaxpr holding checkpoint_name under jax_remat3)
    "to_lojax": lambda prim, fn: setattr(prim, "to_lojax", fn),
    # smartvjp's own: how smartvjp_call's bind processes an unprocessed call
    "process": lambda prim, fn: None,
}


@dataclasses.dataclass(frozen=True)
class Code:
  """A traced rule (no constants of its own) on the equation's inputs at
  ``positions`` (``None``: all), keeping its first ``num_outs`` outputs, then
  ``post``; ``role``: the user's rule it is."""
  jaxpr: Any
  role: str
  positions: tuple | None = None
  num_outs: int | None = None
  post: Callable | None = None

  def inputs(self, args) -> list:
    return list(args) if self.positions is None else \
        [args[i] for i in self.positions]

  def finish(self, outs) -> list:
    outs = list(outs) if self.num_outs is None else list(outs[:self.num_outs])
    return self.post(outs) if self.post is not None else outs


def live_code(c: Code):
  """``c``'s jaxpr without code its kept outputs do not need, nested
  ``jit``s too (a traced rule is not dead-code eliminated by JAX: megablox's
  ``gmm`` would otherwise lower an unused ``jnp.linspace`` per call)."""
  n = len(c.jaxpr.jaxpr.outvars)
  keep = n if c.num_outs is None else c.num_outs
  return jx.dce_jaxpr_keep_inputs(c.jaxpr, [i < keep for i in range(n)])


def eval_scoped(jaxpr, scope_name: str, args) -> list:
  with jax.named_scope(scope_name):
    return jx.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)


def dce_whole(used_outputs, eqn):
  if not any(used_outputs) and not jx.effects_keep_alive(eqn.effects):
    return [False] * len(eqn.invars), None
  return [True] * len(eqn.invars), eqn


def discharged(jaxpr, should, args, positions=None):
  """``(final value of each discharged reference or None, outs)``; the
  rule reads only ``args[i]`` for ``i`` in ``positions``."""
  positions = list(range(len(args)) if positions is None else positions)
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
  """JAX's JVP of a rule's code with respect to the inputs that move only
  (as ``jax.custom_vjp`` differentiates its rules); JAX's error gets a note
  naming the rule."""
  call = params["call"]
  moving = [type(t) is not jx.ad_util.Zero for t in tangents]

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


def checked_rule(ctx, error, enabled, fn, args, call, role):
  """``checkify`` of a rule's code: ``fn(*args)`` traced, checked and bound
  as a ``smartvjp_rule``; returns ``(error, outs)``."""
  what = f"smart_custom_vjp {ROLE_NAMES[role]}"
  err_vals, err_tree = tree_util.tree_flatten(error)
  n_err = len(err_vals)
  avals = [jx.core.typeof(a) for a in args]
  name_fun = getattr(call.rules, role) or call.rules.fun
  inner, inner_consts = jx.trace_to_closed_jaxpr(
      lambda *xs: list(fn(*xs)), avals, what, name_fun, avals)
  store = {}

  def checked(*xs):
    err, outs = jx.checkify_jaxpr(ctx, inner.jaxpr, enabled, err_tree,
                                  *xs[:n_err], *inner_consts, *xs[n_err:])
    leaves, store["tree"] = tree_util.tree_flatten(err)
    return [*leaves, *outs]

  all_avals = [*(jx.core.typeof(e) for e in err_vals), *avals]
  jaxpr, consts = jx.trace_to_closed_jaxpr(checked, all_avals, what, name_fun,
                                           all_avals)
  outs = rule_p.bind(*consts, *err_vals, *args, call=call,
                     which="f" if role == "fun" else role, jaxpr=jaxpr)
  n_out_err = store["tree"].num_leaves
  return (tree_util.tree_unflatten(store["tree"], outs[:n_out_err]),
          list(outs[n_out_err:]))


def _pp_rule(shows):
  def pp(eqn, context, settings):
    params = dict(eqn.params)
    call = params.pop("call")
    name, shown = shows(call, params)
    for k in ("fwd", "which", "jaxpr"):
      params.pop(k, None)
    schedule = params.pop("schedule", None)
    if schedule is not None:
      shown.update(forward=schedule.forward.value,
                   backward=schedule.shown_backward)
    shown.update((k, v) for k, v in params.items() if v is not None)
    return jx.pp_eqn(eqn.replace(params=dict(shown, f=call.name)),
                     context, settings, name=name or eqn.primitive.name)
  return pp


def _rule_names(call, *roles, fwd=None) -> dict:
  shown = {r: call.rules.rule_name(r) for r in roles
           if getattr(call.rules, r) is not None}
  if fwd is not None and fwd.num_new_res:
    shown["num_res"] = fwd.num_new_res
  return shown


def register(prim, kind: str, fn: Callable) -> None:
  if kind not in _KINDS:
    raise TypeError(f"{prim.name}: unknown rule kind {kind!r}; known: "
                    f"{sorted(_KINDS)}")
  if kind in RULES.setdefault(prim.name, {}):
    raise ValueError(f"{prim.name}: a {kind} rule is registered already")
  RULES[prim.name][kind] = fn
  _KINDS[kind](prim, fn)


def replace_rule(prim, kind: str, fn: Callable) -> None:
  del RULES[prim.name][kind]
  register(prim, kind, fn)


def register_with_logs(prim, fn, collecting, merge) -> None:
  RULES[prim.name]["transpose_with_logs"] = fn
  jx.register_transpose_with_logs(prim, fn, collecting, merge)


_CODE: dict = {}     # primitive -> its code(**params) (define's)


def code_of(eqn) -> Code | None:
  """What an equation of one of smartvjp's primitives runs (``Code``:
  its jaxpr, role, inputs), or ``None`` for any other equation."""
  code = _CODE.get(eqn.primitive)
  return None if code is None else code(**eqn.params)


def define(name: str, *, abstract_eval: Callable, shows: Callable,
           code: Callable | None = None, role: Callable = lambda p: "fun",
           jvp: Callable | str | None = None, bind: Callable | None = None):
  """A new primitive with its generic rules registered: ``pp`` (``shows``:
  the printed name and rule names), ``dce``, and with ``code(**params) ->
  Code`` the rest (:func:`define_evaluation`). ``jvp="elsewhere"``:
  registered by its transformation's module; ``bind``: wraps every bind."""
  prim = _SmartPrimitive(name)
  register(prim, "abstract_eval", abstract_eval)
  register(prim, "pp", _pp_rule(shows))
  register(prim, "dce", dce_whole)
  if code is not None:
    def impl(*args, **params):
      c = code(**params)
      return c.finish(eval_scoped(c.jaxpr, params["call"].scopes[c.role],
                                  c.inputs(args)))

    def inline(**params):
      c = code(**params)
      if c.post is not None:
        return None
      return (live_code(c), params["call"].scopes[c.role], c.positions,
              c.num_outs)

    def discharge(should, *args, **params):
      c = code(**params)
      with jax.named_scope(params["call"].scopes[c.role]):
        new_args, outs = discharged(c.jaxpr, should, args, c.positions)
      return new_args, c.finish(outs)
    define_evaluation(prim, impl, role, jvp=jvp, discharge=discharge,
                      inline=inline)

    def pallas_cost(ctx, **params):   # the code it runs, as for jit's
      del ctx
      c = jx.pallas_cost.cost_estimate_jaxpr(live_code(code(**params)))
      return jx.pallas_cost.CostEstimate(
          flops=c.flops, transcendentals=c.transcendentals,
          bytes_accessed=c.bytes_accessed)
    register(prim, "pallas_cost", pallas_cost)
    _CODE[prim] = code
    # the one sub-jaxpr walker (_jaxprs.inner_jaxprs) runs the code it runs
    _jaxprs.register_inner_jaxprs(
        prim, lambda **params: [live_code(code(**params)).jaxpr])
  if bind is not None:
    default = prim.bind
    prim.bind = lambda *args, **params: bind(default, *args, **params)
  return prim


def define_evaluation(prim, impl: Callable, role: Callable, *,
                      jvp: Callable | str | None = None,
                      discharge: Callable | None = None,
                      inline: Callable | None = None) -> None:
  """Registers what follows from ``impl``: evaluation, lowering, ``checkify``,
  its JVP (unless given) and state discharge (unless given)."""
  def traced_discharge(should, *args, **params):
    avals = [jx.state_types.AbstractRef(jx.core.typeof(a)) if d else jx.core.typeof(a)
             for a, d in zip(args, should)]
    jaxpr, consts = jx.trace_to_closed_jaxpr(
        lambda *xs: impl(*xs, **params), avals, prim.name, impl, avals)
    new_args, outs = discharged(
        jaxpr, [False] * len(consts) + list(should), [*consts, *args])
    return new_args[len(consts):], outs

  def checkify(ctx, error, enabled, *args, **params):
    return checked_rule(ctx, error, enabled,
                        lambda *xs: impl(*xs, **params), args,
                        params["call"], role(params))

  def derivative(primals, tangents, **params):
    return rule_jvp(impl, role(params), list(primals), list(tangents),
                    **params)

  # lowering: the traced code inlined where it can be, else impl traced
  RULES.setdefault(prim.name, {})["lowering"] = impl
  jx.register_lowering(prim, impl, inline)
  for kind, fn in (("impl", impl),
                   ("discharge", discharge or traced_discharge),
                   ("checkify", checkify), ("jvp", jvp or derivative)):
    if fn != "elsewhere":
      register(prim, kind, fn)


def _positional_effects(code_of, **params):
  c = code_of(**params)
  effs = jx.positional_effects(c.jaxpr)
  if c.positions is None:
    return effs
  return jx.move_input_effects(effs, lambda i: c.positions[i])


def _code_abstract_eval(code_of, out_avals):
  def abstract_eval(*avals, **params):
    return list(out_avals(**params)), _positional_effects(code_of, **params)
  return abstract_eval


# -- the five primitives ----------------------------------------------------------

def _call_code(*, call):
  return Code(call.jaxpr, "fun")


def _bind_call(default, *args, call):
  """A call bound unprocessed is processed by its ``process`` rule
  (``_process.py``), as JAX looks up ``process_custom_vjp_call`` on the
  current trace; that ends in ``default``, the plain bind."""
  if getattr(call, "unprocessed", False):
    return RULES[call_p.name]["process"](default, list(args), call)
  return default(*args, call=call)


# its JVP (the custom rule: a smartvjp_jvp) is _ad.py's
call_p = define("smartvjp_call", code=_call_code,
                shows=lambda call, p: (None, {}),
                abstract_eval=_code_abstract_eval(
                    _call_code, lambda *, call: call.out_avals),
                jvp="elsewhere", bind=_bind_call)


def _offloaded(call, offload):
  if offload is None:
    return None
  n = call.num_outs

  def post(outs):
    return [*outs[:n], *(r if space is None else jax.device_put(r, space)
                         for r, space in zip(outs[n:], offload))]
  return post


def _rule_code(*, call, which, fwd=None, offload=None, jaxpr=None,
               part=None):
  """``"f"``: ``f`` on ``[*f_consts, *fwd_consts, *primals]`` (``fwd_consts``
  for its derivative); ``"fwd"``: ``fwd`` on ``[*fwd_consts, *primals]``;
  otherwise the traced rule ``jaxpr``. ``part``: only shown."""
  del part
  if jaxpr is not None:
    return Code(jaxpr, "fun" if which == "f" else which)
  if which == "f":
    f_consts, fwd_consts, primals, _ = call.split_jvp_args(
        range(call.num_consts + (fwd.num_consts if fwd is not None else 0)
              + call.num_primals), fwd)
    return Code(call.jaxpr, "fun",
                positions=(*f_consts, *primals) if fwd_consts else None)
  return Code(fwd.jaxpr, "fwd", post=_offloaded(call, offload))


def _rule_out_avals(*, call, which, fwd=None, offload=None, jaxpr=None,
                    part=None):
  del part
  if jaxpr is not None:
    return jaxpr.out_avals
  if which == "f":
    return call.out_avals
  outs = list(fwd.jaxpr.out_avals)
  if offload is not None:
    n = call.num_outs
    outs[n:] = [a if space is None else a.update(memory_space=space)
                for a, space in zip(outs[n:], offload)]
  return outs


def _rule_jvp(primals, tangents, **params):
  """The forward pass's ``f`` differentiates as ``fwd``'s primal outputs,
  which JAX would have run there (a straight-through estimator's ``floor``)."""
  call, fwd = params["call"], params.get("fwd")
  if params["which"] != "f" or fwd is None or params.get("jaxpr") is not None:
    return rule_jvp(rule_p.impl, _rule_role(params), list(primals),
                    list(tangents), **params)

  def fwd_primal_outs(*args, call):
    outs = eval_scoped(fwd.jaxpr, call.scopes["fwd"], args)
    return outs[:call.num_outs]
  return rule_jvp(fwd_primal_outs, "fwd", call.split_call_args(primals)[1],
                  call.split_call_args(tangents)[1], call=call)


def _rule_role(params) -> str:
  return "fun" if params["which"] == "f" else params["which"]


def _bind_named(default, *args, **params):
  """A named residual leaves ``fwd``'s equation through ``checkpoint_name``,
  as from ``jax.custom_vjp``'s inlined ``fwd``, so outer policies see it.
  An eager ``shard_map`` compiles each primitive alone: there the rule's code
  runs equation by equation, as ``jax.custom_vjp``'s inlined rules do."""
  if isinstance(jx.core.trace_ctx.trace, jx.shard_map.ShardMapTrace):
    return rule_p.impl(*args, **params)
  outs = default(*args, **params)
  if params["which"] != "fwd" or params.get("jaxpr") is not None:
    return outs
  n = params["call"].num_outs
  return [*outs[:n], *(r if name is None else jx.ad_checkpoint.name_p.bind(r, name=name)
                       for r, name in zip(outs[n:],
                                          params["fwd"].new_res_names))]


def _rule_shows(call, p):
  which, fwd = p["which"], p.get("fwd")
  return _PRINTED[which], _rule_names(
      call, *(("fwd",) if which in ("f", "fwd") else (which,)), fwd=fwd)


_PRINTED = {"f": "smartvjp_primal", "fwd": "smartvjp_fwd",
            "bwd": "smartvjp_bwd", "fwd_bwd": "smartvjp_bwd"}


rule_p = define("smartvjp_rule", code=_rule_code, shows=_rule_shows,
                abstract_eval=_code_abstract_eval(_rule_code, _rule_out_avals),
                role=_rule_role, jvp=_rule_jvp, bind=_bind_named)
# evaluated inline where a traced rule holds high-level primitives
# (checkpoint_name under jax_remat3) and JAX needs low-level ones
register(rule_p, "to_lojax", rule_p.impl)


def _rem_code(*, call, fwd, schedule):
  """``f`` where ``fwd_bwd`` will run, else ``fwd``'s primal outputs (the
  rem side's ``fwd``)."""
  if schedule.runs_fwd_bwd:
    return _rule_code(call=call, which="f", fwd=fwd)
  _, fwd_consts, primals, _ = call.split_jvp_args(
      range(call.num_consts + fwd.num_consts + call.num_primals), fwd)
  return Code(fwd.jaxpr, "fwd", positions=(*fwd_consts, *primals),
              num_outs=call.num_outs)


def _rem_abstract_eval(*avals, call, fwd, schedule):
  effects = jx.move_input_effects(jx.positional_effects(fwd.jaxpr),
                                  lambda i: i + call.num_consts)
  if schedule.runs_fwd_bwd:
    effects |= _positional_effects(_rem_code, call=call, fwd=fwd,
                                   schedule=schedule)
  return list(call.out_avals), effects


# its JVP (a smartvjp_jvp with the rem side's fwd) is _ad.py's
rem_p = define("smartvjp_rem", code=_rem_code, abstract_eval=_rem_abstract_eval,
               shows=lambda call, p: (None, _rule_names(call, "fwd")),
               role=lambda p: "fwd_bwd" if p["schedule"].runs_fwd_bwd
               else "fwd", jvp="elsewhere")


# -- smartvjp_jvp and smartvjp_lin: evaluated by forward mode (_ad.py) -----------

def tangent_avals(avals, nz) -> list:
  return [a.to_tangent_aval() for a, n in zip(avals, nz) if n]


def lin_out_avals(call, fwd):
  """``fwd``'s output types (as ``jax.custom_vjp``) where ``fwd`` ran, else ``f``'s."""
  if fwd is not None and fwd.out_avals:
    return fwd.out_avals
  return call.out_avals


def _jvp_abstract_eval(*avals, call, fwd, in_nz, schedule):
  nc, nw = call.num_consts, 0 if fwd is None else fwd.num_consts
  # inputs [*f_consts, *fwd_consts, *primals, *tangents]: f's and fwd's own
  # input positions moved there
  effects = jx.move_input_effects(jx.positional_effects(call.jaxpr),
                                  lambda i: i if i < nc else i + nw)
  if fwd is not None:
    effects |= jx.move_input_effects(jx.positional_effects(fwd.jaxpr),
                                     lambda i: i + nc)
  return [*call.out_avals, *tangent_avals(call.out_avals, call.out_nz)], effects


def _lin_abstract_eval(*avals, call, fwd, in_nz, reload):
  return tangent_avals(lin_out_avals(call, fwd), call.out_nz), frozenset()


def forward_role(params) -> str:
  return "bwd" if params["fwd"] is not None else "fwd_bwd"


# evaluated by forward mode: _ad.py calls define_evaluation for them
jvp_p = define("smartvjp_jvp", abstract_eval=_jvp_abstract_eval,
               shows=lambda call, p: (None, _rule_names(
                   call, "fwd", "fwd_bwd",
                   *(("bwd",) if p["fwd"] is not None else ()), fwd=p["fwd"])))
lin_p = define("smartvjp_lin", abstract_eval=_lin_abstract_eval,
               shows=lambda call, p: (None, _rule_names(
                   call, *(("fwd", "bwd") if p["fwd"] is not None
                           else ("fwd_bwd",)), fwd=p["fwd"])))
