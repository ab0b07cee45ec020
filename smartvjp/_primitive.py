"""smartvjp's five primitives, each defined by one call that derives its
generic rules.

All have multiple results and carry a ``CallSpec`` (``_spec.py``) as their
``call`` param. Why each is a primitive of its own:

================== ======================================================
primitive          why
================== ======================================================
``smartvjp_call``  the undifferentiated call ``[*f_consts, *primals] ->
                   outs``: the equation JAX's transformations meet first,
                   whose JVP, linearization and remat3 rules decide the rest
``smartvjp_rule``  one user rule's traced code (``which``: ``"f"``,
                   ``"fwd"``, ``"bwd"`` or ``"fwd_bwd"``) where the plan
                   placed it: partial evaluation places it and nothing turns
                   it into another rule behind the user's back; jaxprs and
                   HLO name the rule; higher-order AD differentiates the code
                   JAX would have run (``fwd``'s for ``"f"``)
``smartvjp_jvp``   primal and tangent outputs together, as
                   ``jax.checkpoint`` partially evaluates them, so that its
                   rules, not dead-code elimination, place the user's rules;
                   its ``schedule`` says what each pass runs
``smartvjp_lin``   the linear map the backward pass transposes: to ``bwd``
                   on ``fwd``'s residuals, or to ``fwd_bwd`` on the primal
                   inputs (``fwd=None``)
``smartvjp_rem``   remat3's rematerialized side: the call not differentiated
                   yet, carrying its decided schedule (and the values the
                   forward pass saved) until the backward region
                   differentiates it
================== ======================================================

:func:`define` makes a primitive and registers what follows from what it
evaluates (``code``: a traced rule over some of its inputs, see
:class:`Code`): evaluation and lowering under the rule's named scope,
abstract evaluation, printing with the user's rule names, state discharge,
``checkify`` of the rule's code, the JVP of that code (higher order) and
dead-code elimination of the whole equation. Only what is specific to a
primitive is given to it. The transformation rules specific to one
primitive are registered beside their definitions in the module of their
transformation (``_ad``, ``_pe``, ``_batching``, ``_remat3``,
``_checkify``) with :func:`register`, right after their definitions, under
names of the form ``_<primitive>_<rule>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax import tree_util

from smartvjp import _cache
from smartvjp import _facade as jx


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
    "remat3": jx.register_remat3,
    # how JAX evaluates prim where it needs low-level primitives only (a
    # jaxpr holding checkpoint_name under jax_remat3)
    "to_lojax": lambda prim, fn: setattr(prim, "to_lojax", fn),
    # smartvjp's own: how smartvjp_call's bind processes an unprocessed call
    "process": lambda prim, fn: None,
}

# the user's rule each role names, and how an error or a scope calls it
ROLE_NAMES = {"fun": "f", "fwd": "fwd", "bwd": "bwd", "fwd_bwd": "fwd_bwd"}


@dataclasses.dataclass(frozen=True)
class Code:
  """What an equation evaluates: ``jaxpr`` (a traced rule with no constants
  of its own) on the equation's inputs at ``positions`` (``None``: all of
  them), keeping its first ``num_outs`` outputs (``None``: all), then
  ``post`` (a function of the output list) if given. ``role``: the user's
  rule it is (``"fun"``, ``"fwd"``, ``"bwd"``, ``"fwd_bwd"``)."""
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
  """``c``'s jaxpr without the code that none of its kept outputs needs, in
  nested ``jit``s too (a traced rule is not dead-code eliminated, where
  JAX's partial evaluation eliminates an inlined ``fwd``: the step
  ``jnp.linspace`` computes and drops inside megablox's ``gmm`` would
  otherwise be lowered once per call); its inputs all kept."""
  n = len(c.jaxpr.jaxpr.outvars)
  keep = n if c.num_outs is None else c.num_outs
  return jx.dce_jaxpr_keep_inputs(c.jaxpr, [i < keep for i in range(n)])


def scope(call, role: str) -> str:
  """The named scope of a user's rule: ``smartvjp/<f>/<rule>``."""
  return f"smartvjp/{call.name}/{ROLE_NAMES.get(role, role)}"


def eval_scoped(jaxpr, scope_name: str, args) -> list:
  """A traced rule (no constants of its own) evaluated under a named scope,
  so jaxprs and HLO name the user's rule."""
  with jax.named_scope(scope_name):
    return jx.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)


def evaluate(code: Code, call, args) -> list:
  return code.finish(eval_scoped(code.jaxpr, scope(call, code.role),
                                 code.inputs(args)))


def dce_whole(used_outputs, eqn):
  """Drops an equation none of whose outputs is used and that has no effect
  JAX keeps; else keeps it whole (JAX's default rule)."""
  if not any(used_outputs) and not jx.effects_keep_alive(eqn.effects):
    return [False] * len(eqn.invars), None
  return [True] * len(eqn.invars), eqn


def discharged(jaxpr, should, args, positions=None):
  """A traced rule evaluated with its references at the ``should`` positions
  discharged: ``(final value of each such reference or None, outs)``. With
  ``positions``, the rule reads only ``args[i]`` for ``i`` there (the
  equation's other inputs feed another rule)."""
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
  """JAX's JVP of a rule's code (higher order: grad of grad, hessian), with
  respect to the inputs that move only (as ``jax.custom_vjp`` differentiates
  its rules), so a nested call inside the rule sees its closed-over values
  held fixed. JAX's own exception goes on (an opaque rule's, say), with a
  note naming the rule and ``what`` differentiated it."""
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
  """``jax.experimental.checkify`` of a rule's code: ``fn(*args)`` (the code
  of the user's rule ``role``) traced, checked and bound as a
  ``smartvjp_rule`` over the checked jaxpr, named after the rule; returns
  ``(error, outs)``. ``checkify`` interprets a jaxpr equation by equation,
  and smartvjp's primitives hide the user's code in their params, so each
  interprets it here."""
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


def pp_rule(eqn, context, settings):
  """Prints an equation with the names of the user's rules it runs in place
  of the spec objects (``smartvjp_rule`` under the role of its rule:
  ``smartvjp_primal`` for ``f``, ``smartvjp_fwd``, ``smartvjp_bwd``), and
  for a ``fwd`` that a remat policy split, which side it runs (``part=saved``
  in the forward pass, ``part=rest`` in the backward region)."""
  params = dict(eqn.params)
  call = params.pop("call")
  rules = call.rules
  shown = {"f": call.name}
  fwd = params.pop("fwd", None)
  which = params.pop("which", None)
  prim = eqn.primitive
  name = prim.name
  if prim is rule_p:
    name = _PRINTED[which]
  if (prim in (jvp_p, rem_p) or (prim is rule_p and which in ("f", "fwd"))
      or (prim is lin_p and fwd)) and rules.fwd is not None:
    shown["fwd"] = rules.rule_name("fwd")
  if prim in (jvp_p, lin_p) and fwd is not None and rules.bwd is not None:
    shown["bwd"] = rules.rule_name("bwd")
  if (prim is jvp_p or (prim is lin_p and fwd is None)) and \
      rules.fwd_bwd is not None:
    shown["fwd_bwd"] = rules.rule_name("fwd_bwd")
  if prim is rule_p and which in ("bwd", "fwd_bwd"):
    shown[which] = rules.rule_name(which)
  if prim is rule_p and which == "fwd" and fwd is not None and \
      fwd.split_part is not None:
    shown["part"] = fwd.split_part
  params.pop("jaxpr", None)
  if fwd is not None and fwd.num_new_res and prim is not rem_p:
    shown["num_res"] = fwd.num_new_res
  schedule = params.pop("schedule", None)
  if schedule is not None:   # the plan's, as forward=... backward=...
    shown["forward"] = schedule.forward.value
    shown["backward"] = schedule.backward.value
  shown.update((k, v) for k, v in params.items() if v is not None)
  return jx.pp_eqn(eqn.replace(params=shown), context, settings,
                   name=name)


_PRINTED = {"f": "smartvjp_primal", "fwd": "smartvjp_fwd",
            "bwd": "smartvjp_bwd", "fwd_bwd": "smartvjp_bwd"}


def register(prim, kind: str, fn: Callable) -> None:
  """Registers one rule of ``prim`` with JAX and in :data:`RULES`."""
  if kind not in _KINDS:
    raise TypeError(f"{prim.name}: unknown rule kind {kind!r}; known: "
                    f"{sorted(_KINDS)}")
  if kind in RULES.setdefault(prim.name, {}):
    raise ValueError(f"{prim.name}: a {kind} rule is registered already")
  RULES[prim.name][kind] = fn
  _KINDS[kind](prim, fn)


def replace_rule(prim, kind: str, fn: Callable) -> None:
  """Registers ``fn`` as ``prim``'s ``kind`` rule in place of the one
  :func:`define` derived (a primitive-specific dead-code elimination or
  ``checkify``)."""
  del RULES[prim.name][kind]
  register(prim, kind, fn)


def register_with_logs(prim, fn, collecting, merge) -> None:
  """``fn`` (``prim``'s transpose rule) also where JAX's backward pass
  collects logs (``_facade.register_transpose_with_logs``)."""
  RULES[prim.name]["transpose_with_logs"] = fn
  jx.register_transpose_with_logs(prim, fn, collecting, merge)


def define(name: str, *, abstract_eval: Callable,
           code: Callable | None = None, role: Callable = lambda p: "fun",
           jvp: Callable | str | None = None, bind: Callable | None = None):
  """A new primitive with its generic rules registered.

  ``abstract_eval`` is required; ``pp`` (:func:`pp_rule`) and ``dce``
  (:func:`dce_whole`) are derived. ``code(**params) -> Code``: what an
  equation evaluates, from which :func:`define_evaluation` derives the
  rest (without it, the primitive's module calls that with its own
  ``impl``). ``role(params)``: the user's rule that errors and notes name.
  ``jvp``: the primitive's own JVP rule, where it is not the derivative of
  its code (``"elsewhere"``: registered by its transformation's module). ``bind``: the primitive's own bind, given the default bind and
  the arguments (every bind of it, JAX's evaluation of a jaxpr included).
  Further rules are added with :func:`register`.
  """
  prim = _SmartPrimitive(name)
  register(prim, "abstract_eval", abstract_eval)
  register(prim, "pp", pp_rule)
  register(prim, "dce", dce_whole)
  if code is not None:
    def impl(*args, **params):
      return evaluate(code(**params), params["call"], args)

    def inline(**params):
      c = code(**params)
      if c.post is not None:
        return None
      return (live_code(c), scope(params["call"], c.role), c.positions,
              c.num_outs)

    def discharge(should, *args, **params):
      c = code(**params)
      with jax.named_scope(scope(params["call"], c.role)):
        new_args, outs = discharged(c.jaxpr, should, args, c.positions)
      return new_args, c.finish(outs)
    define_evaluation(prim, impl, role, jvp=jvp, discharge=discharge,
                      inline=inline)
  if bind is not None:
    default = prim.bind
    prim.bind = lambda *args, **params: bind(default, *args, **params)
  return prim


def define_evaluation(prim, impl: Callable, role: Callable, *,
                      jvp: Callable | str | None = None,
                      discharge: Callable | None = None,
                      inline: Callable | None = None) -> None:
  """Registers what follows from ``impl(*args, **params) -> outs``:
  evaluation and lowering, ``checkify`` of it, its JVP (higher order:
  ``impl`` differentiated, unless ``jvp`` is given) and, unless given, its
  state discharge (``impl`` traced with the references as inputs, then
  discharged)."""
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
  """Abstract evaluation from ``code``: ``out_avals(**params)`` and the
  code's effects at the equation's input positions."""
  def abstract_eval(*avals, **params):
    return list(out_avals(**params)), _positional_effects(code_of, **params)
  return abstract_eval


# -- the five primitives ----------------------------------------------------------

def _call_code(*, call):
  return Code(call.jaxpr, "fun")


def _bind_call(default, *args, call):
  """Every bind of ``smartvjp_call``: a call bound unprocessed is processed
  by its ``process`` rule (``_process.py``), looked up as JAX looks up a
  ``jax.custom_vjp`` call's ``process_custom_vjp_call`` on the current
  trace, which ends in ``default``, the plain bind, of the processed call;
  a processed one is bound as it is."""
  if getattr(call, "unprocessed", False):
    return RULES[call_p.name]["process"](default, list(args), call)
  return default(*args, call=call)


# its JVP (the custom rule: a smartvjp_jvp) is _ad.py's
call_p = define("smartvjp_call", code=_call_code,
                abstract_eval=_code_abstract_eval(
                    _call_code, lambda *, call: call.out_avals),
                jvp="elsewhere", bind=_bind_call)


def _num_fwd_consts(fwd) -> int:
  return 0 if fwd is None else fwd.num_consts


def _offloaded(call, offload):
  if offload is None:
    return None
  n = call.num_outs

  def post(outs):
    return [*outs[:n], *(r if space is None else jax.device_put(r, space)
                         for r, space in zip(outs[n:], offload))]
  return post


def _rule_code(*, call, which, fwd=None, offload=None, jaxpr=None):
  """``smartvjp_rule``'s code per ``which``:

  * ``"f"``: ``f`` on ``[*f_consts, *fwd_consts, *primals]`` (the
    ``fwd_consts`` are there for its derivative, ``fwd``'s code);
  * ``"fwd"``: ``fwd`` (``fwd.jaxpr``) on ``[*fwd_consts, *primals]``, its
    computed residuals offloaded where ``offload`` says;
  * ``"bwd"``, ``"fwd_bwd"``, and a rule ``checkify`` checked: the traced
    rule ``jaxpr`` on all the inputs.
  """
  if jaxpr is not None:
    return Code(jaxpr, "fun" if which == "f" else which)
  if which == "f":
    n1 = call.num_consts
    n2 = n1 + _num_fwd_consts(fwd)
    return Code(call.jaxpr, "fun",
                positions=None if n2 == n1 else
                (*range(n1), *range(n2, n2 + call.num_primals)))
  return Code(fwd.jaxpr, "fwd", post=_offloaded(call, offload))


def _rule_out_avals(*, call, which, fwd=None, offload=None, jaxpr=None):
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
  """Higher order: the rule's code differentiated, except that the forward
  pass's ``f`` differentiates as ``fwd``'s primal outputs, which JAX would
  have run there (a straight-through estimator's ``floor`` differentiates to
  zero); ``f`` itself where only ``fwd_bwd`` is given."""
  call, fwd = params["call"], params.get("fwd")
  if params["which"] != "f" or fwd is None or params.get("jaxpr") is not None:
    return rule_jvp(rule_p.impl, _rule_role(params), list(primals),
                    list(tangents), **params)
  n1 = call.num_consts

  def fwd_primal_outs(*args, call):
    outs = eval_scoped(fwd.jaxpr, scope(call, "fwd"), args)
    return outs[:call.num_outs]
  return rule_jvp(fwd_primal_outs, "fwd", list(primals[n1:]),
                  list(tangents[n1:]), call=call)


def _rule_role(params) -> str:
  return "fun" if params["which"] == "f" else params["which"]


def _bind_named(default, *args, **params):
  """A residual ``fwd`` named with ``checkpoint_name`` leaves ``fwd``'s
  equation through a ``checkpoint_name`` equation, as it leaves
  ``jax.custom_vjp``'s inlined ``fwd``, so that outer remat policies and
  ``jax.ad_checkpoint.print_saved_residuals`` see the name."""
  outs = default(*args, **params)
  if params["which"] != "fwd" or params.get("jaxpr") is not None:
    return outs
  n = params["call"].num_outs
  return [*outs[:n], *(r if name is None else jx.ad_checkpoint.name_p.bind(r, name=name)
                       for r, name in zip(outs[n:],
                                          params["fwd"].new_res_names))]


rule_p = define("smartvjp_rule", code=_rule_code,
                abstract_eval=_code_abstract_eval(_rule_code, _rule_out_avals),
                role=_rule_role, jvp=_rule_jvp, bind=_bind_named)
# evaluated inline where a traced rule holds high-level primitives
# (checkpoint_name under jax_remat3) and JAX needs low-level ones
register(rule_p, "to_lojax", rule_p.impl)


def _rem_code(*, call, fwd, schedule):
  """The rem side undifferentiated: ``f``'s outputs where ``fwd_bwd`` will
  run, else ``fwd``'s primal outputs (``fwd`` is the rem side's: the user's,
  the part of it a split rebuilds, or a pass-through of the saved values)."""
  n1 = call.num_consts
  n2 = n1 + fwd.num_consts
  if schedule.runs_fwd_bwd:
    return Code(call.jaxpr, "fun",
                positions=(*range(n1), *range(n2, n2 + call.num_primals)))
  return Code(fwd.jaxpr, "fwd",
              positions=tuple(range(n1, n2 + call.num_primals)),
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
               role=lambda p: "fwd_bwd" if p["schedule"].runs_fwd_bwd
               else "fwd", jvp="elsewhere")


# -- smartvjp_jvp and smartvjp_lin: evaluated by forward mode (_ad.py) -----------

def tangent_avals(avals, nz) -> list:
  """The tangent types of the avals where ``nz`` is true."""
  return [a.to_tangent_aval() for a, n in zip(avals, nz) if n]


def lin_out_avals(call, fwd):
  """The primal output types a linear map's tangents follow: ``fwd``'s (as
  ``jax.custom_vjp``'s) where ``fwd`` ran, else ``f``'s."""
  if fwd is not None and fwd.out_avals:
    return fwd.out_avals
  return call.out_avals


def _jvp_abstract_eval(*avals, call, fwd, in_nz, schedule):
  nc, nw = call.num_consts, _num_fwd_consts(fwd)
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
  """The rule forward mode transposes: ``bwd``, or ``fwd_bwd`` without
  ``fwd``."""
  return "bwd" if params["fwd"] is not None else "fwd_bwd"


# evaluated by forward mode: _ad.py calls define_evaluation for them
jvp_p = define("smartvjp_jvp", abstract_eval=_jvp_abstract_eval)
lin_p = define("smartvjp_lin", abstract_eval=_lin_abstract_eval)
