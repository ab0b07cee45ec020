"""Readable jaxprs (rule names, not nested jaxprs), saved-residual reports,
named scopes in HLO, and the wrapper's metadata."""

import inspect
import re

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import print_saved_residuals

from smartvjp import smart_custom_vjp


def make():
  def my_f(x, y):
    """My docstring."""
    return jnp.sin(x) * y

  def my_fwd(x, y):
    return my_f(x, y), (jnp.cos(x), jnp.sin(x), y)

  def my_bwd(res, g):
    c, s, y = res
    return c * y * g, s * g

  F = smart_custom_vjp(my_f)
  F.defvjp(my_fwd, my_bwd)
  return F


X = jnp.ones(3)


def test_metadata_preserved():
  F = make()
  assert F.__name__ == "my_f" and F.__doc__ == "My docstring."
  assert list(inspect.signature(F).parameters) == ["x", "y"]
  assert F.__wrapped__.__name__ == "my_f"


def test_jaxpr_shows_rule_names_not_jaxprs():
  F = make()
  loss = lambda x, y: jnp.sum(jax.checkpoint(F)(x, y) ** 2)
  text = str(jax.make_jaxpr(jax.grad(loss))(X, X))
  assert "smartvjp_primal[f=my_f fwd=my_fwd num_res=2]" in text  # remat fwd pass
  assert "smartvjp_fwd[f=my_f fwd=my_fwd num_res=2]" in text  # y is forwarded
  assert "smartvjp_bwd[bwd=my_bwd f=my_f]" in text
  assert text.count("{ lambda") == 2   # the program and remat's body only


def test_saved_residuals(capsys):
  F = make()
  print_saved_residuals(lambda x, y: jnp.sum(F(x, y) ** 2), X, X)
  plain = capsys.readouterr().out.strip().splitlines()
  # cos and sin: outputs of fwd's equation (one primitive, smartvjp_rule,
  # runs every user rule; jaxprs print it as smartvjp_fwd), from fwd's line
  assert sum("output of smartvjp_rule" in line for line in plain) == 2
  assert "f32[3] from the argument y" in plain  # forwarded, not copied
  print_saved_residuals(jax.checkpoint(lambda x, y: jnp.sum(F(x, y) ** 2)),
                        X, X)
  remat = capsys.readouterr().out.strip().splitlines()
  assert sorted(remat) == ["f32[3] from the argument x",
                           "f32[3] from the argument y"]


def test_named_scopes_in_hlo():
  F = make()
  loss = lambda x, y: jnp.sum(jax.checkpoint(F)(x, y) ** 2)
  hlo = jax.jit(jax.grad(loss)).lower(X, X).as_text(debug_info=True)
  # each rule's operations are located under its scope; a transformation
  # JAX applied to the equation wraps the scope, as in "jvp(smartvjp/my_f/f)"
  for rule in ("f", "fwd", "bwd"):
    assert re.search(rf"smartvjp/my_f/{rule}\)*/(sin|cos|mul)", hlo), rule


def _split_program():
  """A fwd that dots_saveable splits: its dot output is saved, the sin of
  it is the rest, recomputed in the backward region."""
  def my_f(x, w):
    return jnp.tanh(x @ w)

  def my_fwd(x, w):
    y = x @ w
    return jnp.tanh(y), (x, w, jnp.sin(y))

  def my_bwd(res, g):
    x, w, s = res
    return (g * s) @ w.T, x.T @ (g * s)

  F = smart_custom_vjp(my_f)
  F.defvjp(my_fwd, my_bwd)
  policy = jax.checkpoint_policies.dots_saveable
  loss = lambda x, w: jnp.sum(jax.checkpoint(F, policy=policy)(x, w) ** 2)
  x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
  return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)


def _fwd_equations(jaxpr, depth=0):
  """``[(depth, printed equation)]`` of the fwd equations in program
  order, nested ones too."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "smartvjp_rule" and eqn.params["which"] == "fwd":
      out.append((depth, " ".join(str(eqn).split())))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else [value]:
        sub = getattr(sub, "jaxpr", sub)        # a ClosedJaxpr's jaxpr
        if hasattr(sub, "eqns") and eqn.primitive.name != "smartvjp_rule":
          out.extend(_fwd_equations(sub, depth + 1))
  return out


def test_a_split_fwd_prints_which_part_it_runs(ad_mode):
  """Both sides of a split fwd print as smartvjp_fwd; part=saved is the
  side in the forward pass (what the policy saves), part=rest the side in
  the backward region. Under the remat3 flags the rest, whose primal
  outputs nobody reads, is pruned to fwd's traced code and prints as
  smartvjp_fwd[f=... fwd=... part=rest] without num_res (getting-started
  says so); part is the equation's param on both paths."""
  # in program order: the forward pass's, then the backward region's (a
  # nested jaxpr, or inlined after it under remat3 on jax 0.10)
  eqns = _fwd_equations(_split_program().jaxpr)
  assert len(eqns) == 2, eqns
  (_, forward), (_, backward) = eqns
  assert "smartvjp_fwd[f=my_f fwd=my_fwd num_res=1 part=saved]" in forward
  if ad_mode == "default":
    assert re.search(r"smartvjp_fwd\[ ?f=my_f fwd=my_fwd num_res=1 part=rest ?\]",
                     backward), backward
  else:
    assert "smartvjp_fwd[f=my_f fwd=my_fwd part=rest]" in backward, backward


def test_a_whole_fwd_prints_no_part():
  F = make()
  text = str(jax.make_jaxpr(jax.grad(
      lambda x, y: jnp.sum(jax.checkpoint(F)(x, y) ** 2)))(X, X))
  assert "smartvjp_fwd[" in text and "part=" not in text
