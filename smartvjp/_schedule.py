"""Reading a program's schedule: the smartvjp rule equations of a jaxpr,
where they stand, and :func:`print_schedule`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from smartvjp import _facade as jx
from smartvjp import _jaxprs

# what each smartvjp primitive runs: a rule named by its ``which`` param, or
# always the same one (``smartvjp_rem``'s depends on its schedule)
_RUNS = {"smartvjp_call": "f", "smartvjp_jvp": "jvp", "smartvjp_lin": "lin"}


@dataclasses.dataclass(frozen=True)
class ScheduledRule:
  """One rule equation of a program.

  Attributes:
    which: the user's rule the equation runs: ``"f"``, ``"fwd"``, ``"bwd"``
      or ``"fwd_bwd"``; ``"jvp"`` / ``"lin"`` for forward mode's
      ``smartvjp_jvp`` / ``smartvjp_lin`` (their ``forward=`` and
      ``backward=`` params are the schedule they carry).
    part: for a ``fwd`` that a remat policy split, the side this equation
      is: ``"saved"`` (forward pass: ``f``'s outputs and the saved values)
      or ``"rest"`` (backward region: the other residuals); else ``None``.
      The equation's ``part`` param.
    function: the name of the ``smart_custom_vjp`` function (its ``f``).
    rule: the name of the user's function the equation runs (``f_fwd``),
      or ``None`` where it runs forward mode.
    where: the primitives of the equations it is nested in, outermost
      first (``("remat2",)`` for the rematerialized backward region,
      ``("RematTraced",)`` under JAX's ``jax_remat3`` flags,
      ``("scan", "remat2")`` for one inside a scanned layer); ``()`` at the
      top level.
    repeats: how many times one run of the program runs it: the product of
      the ``length`` of each ``scan`` it is in, ``None`` inside a ``while``
      (not known before it runs).
    equation: the ``JaxprEqn`` itself (its primitive is ``smartvjp_rule``
      for ``f``, ``fwd``, ``bwd`` and ``fwd_bwd``).
  """
  which: str
  part: str | None
  function: str
  rule: str | None
  where: tuple[str, ...]
  repeats: int | None
  equation: Any

  def __str__(self):
    part = f"[part={self.part}]" if self.part else ""
    rule = f" ({self.rule})" if self.rule else ""
    times = ("x?" if self.repeats is None else
             "" if self.repeats == 1 else f"x{self.repeats}")
    where = " > ".join(self.where) or "top level"
    return (f"{self.which}{part}{rule} of {self.function}"
            f"{' ' + times if times else ''}  in {where}")


def _which(eqn) -> str | None:
  name = eqn.primitive.name
  if name == "smartvjp_rule":
    return eqn.params["which"]
  if name == "smartvjp_rem":
    return "fwd_bwd" if eqn.params["schedule"].runs_fwd_bwd else "fwd"
  return _RUNS.get(name)


def rule_equations(jaxpr, where: tuple[str, ...] = (),
                   repeats: int | None = 1) -> list[ScheduledRule]:
  """The rule equations of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``) and
  of the jaxprs its equations run (``_jaxprs.inner_jaxprs``; every
  branch), in program order, each labelled by the primitive or under
  ``jax_remat3`` the high-level primitive (``RematTraced``). A rule's own
  body is not searched: what it calls runs as part of that rule."""
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jx.ClosedJaxpr) else jaxpr
  found = []
  for eqn in jaxpr.eqns:
    which = _which(eqn)
    if which is not None:
      call = eqn.params["call"]
      role = "fun" if which == "f" else which
      found.append(ScheduledRule(
          which=which, part=eqn.params.get("part"), function=call.name,
          rule=(call.rules.rule_name(role)
                if which not in ("jvp", "lin") else None),
          where=where, repeats=repeats, equation=eqn))
      continue
    if eqn.primitive.name.startswith("smartvjp_"):
      continue   # smartvjp_count: RunCounter's step, not a rule
    label = jx.primitive_label(eqn)
    for sub in _jaxprs.inner_jaxprs(eqn):
      inner = (None if repeats is None or sub.trips is None
               else repeats * sub.trips)
      found.extend(rule_equations(sub.jaxpr, (*where, label), inner))
  return found


def print_schedule(fn: Callable, *args: Any, **kwargs: Any) -> list[ScheduledRule]:
  """Prints which smartvjp rules the program of ``fn(*args, **kwargs)``
  runs, and where: one line per rule equation.

  ``fn`` is traced (``jax.make_jaxpr``), not run, and what no output reads
  is removed, as ``jax.jit`` removes it; give it the function you
  would ``jax.jit``, e.g. ``jax.grad(loss)`` or a training step, and its
  arguments (arrays, ``jax.ShapeDtypeStruct``s or pytrees of them). A line
  reads ``fwd_bwd (f_fwd_bwd) of f  in remat2``: the rule (``which``, with
  ``[part=saved]`` / ``[part=rest]`` for the two sides of a ``fwd`` that a
  remat policy split, which between them run ``fwd`` once), the user's
  function it runs, the ``smart_custom_vjp`` function, how many times a
  run of the program runs it where that is not once (``x4`` in a scan of
  length 4, ``x?`` in a ``while``), and the equations it is nested in
  (``remat2``: the rematerialized backward region).

  This is where each rule is placed in the program JAX hands to XLA.
  ``smartvjp.testing.RunCounter`` counts runs of the compiled program
  instead, after XLA has removed what nothing reads; for the same program
  the two agree (``tests/test_run_counter.py`` checks the contract's
  rows), with one exception: under JAX's ``jax_remat3`` flags the program
  can hold a ``fwd`` equation that nothing reads where the policy saves
  its residuals (``everything_saveable``, ``save_only_these_names``),
  which is listed here and removed only when the program is compiled; and
  on jax 0.11 under those flags a rule with effects that only a
  ``fwd_bwd`` follows (``f`` printing) is replayed in the backward region
  but not listed, since JAX 0.11's dead-code elimination drops the replay
  (which declares no outputs) that the compiled program still runs.

  ```python
  import jax, jax.numpy as jnp
  import smartvjp

  @smartvjp.smart_custom_vjp
  def f(x):
    return jnp.sin(x)

  f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  loss = lambda x: jnp.sum(jax.checkpoint(f)(x) ** 2)
  rules = smartvjp.print_schedule(jax.grad(loss), jnp.ones(3))
  # f (f) of f  in top level
  # fwd (<lambda>) of f  in remat2
  # bwd (<lambda>) of f  in remat2
  assert [r.which for r in rules] == ["f", "fwd", "bwd"]
  ```

  Args:
    fn: a function JAX can trace.
    *args: its positional arguments, as for ``jax.make_jaxpr(fn)``.
    **kwargs: its keyword arguments, likewise.

  Returns:
    A list of :class:`ScheduledRule` (``which``, ``part``, ``function``,
    ``rule``, ``where``, ``repeats``, ``equation``), one per rule equation,
    in program order; the printed lines are their ``str``.

  Errors raised while tracing ``fn`` propagate unchanged, as from
  ``jax.make_jaxpr(fn)``.
  """
  closed = jax.make_jaxpr(fn)(*args, **kwargs)
  # what jit hands XLA: the program with what no output reads removed
  rules = rule_equations(jx.dce_jaxpr_keep_inputs(
      closed, [True] * len(closed.jaxpr.outvars)))
  for r in rules:
    print(r)
  if not rules:
    print("no smartvjp rule equations in this program")
  return rules
