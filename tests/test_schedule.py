"""The schedule a jaxpr prints is what runs: the staged equation's
``forward=``/``backward=`` against the rules found in the forward pass and
in the rematerialized backward region of ``grad(checkpoint(F))``."""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax._src.interpreters import partial_eval as pe  # to show one stage

from smartvjp import smart_custom_vjp

X = jnp.ones(3, jnp.float32)


def _make(residual_is_input):
  @smart_custom_vjp
  def F(x):
    return jnp.sin(x)

  if residual_is_input == "named":   # the seed's twin: its input, named
    F.defvjp(lambda x: (jnp.sin(x), checkpoint_name(x, "x")),
             lambda x, g: (jnp.cos(x) * g,))
  elif residual_is_input:   # the seed's fwd
    F.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g,))
  else:
    F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  return F


def _staged_schedule(F):
  jvp = jax.make_jaxpr(lambda x, t: jax.jvp(F, (x,), (t,)))(X, X)
  _, staged, _, _, _ = pe.partial_eval_jaxpr_custom(
      jvp.jaxpr, [False, True], [True, True], False, False,
      jax.checkpoint_policies.nothing_saveable)
  (eqn,) = [e for e in staged.eqns if e.primitive.name == "smartvjp_jvp"]
  return eqn.params["schedule"]


def _passes(F):
  """The rules run by the forward pass and by the backward region."""
  jaxpr = jax.make_jaxpr(jax.grad(
      lambda x: jnp.sum(jax.checkpoint(F)(x) ** 2)))(X).jaxpr
  (region,) = [e.params["jaxpr"] for e in jaxpr.eqns
               if e.primitive.name in ("remat2", "checkpoint")]
  rules = lambda j: [e.params.get("which", e.primitive.name) for e in j.eqns
                     if e.primitive.name.startswith("smartvjp")]
  return rules(jaxpr), rules(region)


@pytest.mark.parametrize("residual_is_input, printed, backward", [
    (True, ("f", "bwd"), ["bwd"]),
    ("named", ("f", "bwd"), ["bwd"]),
    (False, ("f", "fwd+bwd"), ["fwd", "bwd"]),
], ids=["the seed's fwd", "the seed's twin (checkpoint_name)",
        "fwd computes cos x"])
def test_printed_schedule_is_what_runs(residual_is_input, printed, backward):
  F = _make(residual_is_input)
  schedule = _staged_schedule(F)
  assert (schedule.forward.value, schedule.backward.value) == printed
  forward_rules, region_rules = _passes(F)
  assert forward_rules == ["f"]
  assert region_rules == backward


def test_only_the_plan_decides():
  """Outside ``_plan.py`` no module builds a schedule, a plan or what prune
  leaves, or asks ``fwd_or_f`` (the choice between ``f`` and ``fwd``) again;
  ``Facts`` are built by ``_policy`` alone, once per traced ``fwd``. The
  rules ask ``_plan.plan``/``_plan.prune`` and read what they return."""
  import ast
  import os
  pkg = os.path.join(os.path.dirname(__file__), os.pardir, "smartvjp")
  decided = {"Schedule", "Plan", "Pruned", "fwd_or_f", "Facts"}
  found = []
  for name in sorted(os.listdir(pkg)):
    if not name.endswith(".py") or name == "_plan.py":
      continue
    with open(os.path.join(pkg, name), encoding="utf-8") as fh:
      tree = ast.parse(fh.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Call):
        f = node.func
        called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if called in decided and not (called == "Facts"
                                      and name == "_policy.py"):
          found.append(f"{name}:{node.lineno} {called}")
  assert not found, found
