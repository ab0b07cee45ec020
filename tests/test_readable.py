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
