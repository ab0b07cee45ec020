"""Rules whose outputs are not fresh values: constants, inputs, repeats.

A jaxpr of ``f``, ``fwd``, ``bwd`` or ``fwd_bwd`` may have, in any output
position, a ``Literal`` (a Python or numpy constant), an input forwarded
unchanged, or the same variable twice. Each rule set below puts one of those
in the primal outputs, the residuals or the cotangents; every program is
compared with ``jax.custom_vjp`` (or, where ``jax.custom_vjp`` itself fails
on this JAX, with the plain function: every rule set's ``bwd`` is the exact
derivative of its ``f``), on JAX's default path and under the remat3 flags.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import smartvjp


def _rule_sets():
  sets = {}

  # a Python constant among the primal outputs and the residuals
  def f(x):
    return jnp.sin(x), 0.0

  def fwd(x):
    return (jnp.sin(x), 0.0), (jnp.cos(x), 0.0, 2)

  def bwd(r, g):
    return (r[0] * g[0],)
  sets["python_constant"] = (f, fwd, bwd, None)

  # constant arrays (literals and hoisted constants) among them
  def f(x):
    return jnp.sin(x), jnp.float32(3.0)

  def fwd(x):
    return ((jnp.sin(x), jnp.float32(3.0)),
            (jnp.cos(x), jnp.float32(1.0), jnp.ones(3)))

  def bwd(r, g):
    return (r[0] * g[0] * r[1] + 0 * r[2],)
  sets["array_constant"] = (f, fwd, bwd, None)

  # an input forwarded as a primal output and (twice) as a residual
  def f(x):
    return x, jnp.sin(x)

  def fwd(x):
    y = jnp.sin(x)
    return (x, y), (x, x, y, y, checkpoint_name(jnp.cos(x), "r"))

  def bwd(r, g):
    return (g[0] + g[1] * r[4] + 0 * r[0] + 0 * r[3],)
  sets["forwarded_input"] = (f, fwd, bwd, None)

  # one variable twice among the primal outputs, and as a residual
  def f(x):
    y = jnp.sin(x)
    return y, y

  def fwd(x):
    y = jnp.sin(x)
    return (y, y), (y, checkpoint_name(jnp.cos(x), "r"))

  def bwd(r, g):
    return (r[1] * (g[0] + g[1]),)
  sets["repeated_output"] = (f, fwd, bwd, None)

  # bwd returns its cotangent argument, twice
  def f(x, w):
    return x * 1.0 + w

  def fwd(x, w):
    return x * 1.0 + w, ()

  def bwd(r, g):
    return g, g
  sets["bwd_forwards_g"] = (f, fwd, bwd, None)

  # bwd returns a constant cotangent
  def f(x, w):
    return jnp.sin(x) + 0.0 * w

  def fwd(x, w):
    return jnp.sin(x) + 0.0 * w, jnp.cos(x)

  def bwd(r, g):
    return r * g, jnp.zeros(3)
  sets["bwd_constant"] = (f, fwd, bwd, None)

  # fwd_bwd returns its cotangent argument, or constants around it
  def f(x, w):
    return x + jnp.sin(w)

  def fwd(x, w):
    return x + jnp.sin(w), jnp.cos(w)

  def bwd(r, g):
    return g, g * r

  def fwd_bwd(x, w, g):
    return g, g * jnp.cos(w)
  sets["fwd_bwd_forwards_g"] = (f, fwd, bwd, fwd_bwd)

  def fwd_bwd_constant(x, w, g):
    return g * jnp.float32(1.0), jnp.zeros(3) + g * jnp.cos(w)
  sets["fwd_bwd_constant"] = (f, fwd, bwd, fwd_bwd_constant)
  return sets


RULE_SETS = _rule_sets()

POLICIES = {
    "no_remat": "no_remat",
    "checkpoint": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "save_only_r": jax.checkpoint_policies.save_only_these_names("r"),
}


class _Plain:
  """The function without its rules (JAX differentiates ``f`` itself)."""

  def __init__(self, fun):
    self.fun = fun

  def __call__(self, *args):
    return self.fun(*args)


def _build(kind, rules):
  f, fwd, bwd, fwd_bwd = rules
  if kind == "plain":
    return _Plain(f)
  if kind == "jax":
    F = jax.custom_vjp(f)
    F.defvjp(fwd, bwd)
  elif kind == "smart":
    F = smartvjp.smart_custom_vjp(f)
    F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd)
  else:   # "smart_fwd_bwd_only"
    F = smartvjp.smart_custom_vjp(f)
    F.defvjp(fwd_bwd=fwd_bwd)
  return F


def _program(F, nargs, policy, kind):
  remat = ((lambda h: h) if policy == "no_remat"
           else (lambda h: jax.checkpoint(h, policy=policy)))
  argnums = tuple(range(nargs))

  def loss(*a):
    leaves = jax.tree_util.tree_leaves(remat(lambda *b: F(*b))(*a))
    return sum(jnp.sum(jnp.sin(leaf) ** 2) for leaf in leaves)

  if kind == "jit_grad":
    return jax.jit(jax.grad(loss, argnums=argnums))
  if kind == "eager_grad":
    return jax.grad(loss, argnums=argnums)
  if kind == "vmap_grad":
    return jax.jit(jax.vmap(jax.grad(loss, argnums=argnums)))
  if kind == "grad_of_grad":
    return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.cos(jax.grad(loss)(*a)))))
  assert kind == "scan"

  def scanned(*a):
    def body(c, _):
      out = remat(lambda c, *rest: F(c, *rest))(c, *a[1:])
      return jnp.sin(jax.tree_util.tree_leaves(out)[0]), None
    c, _ = jax.lax.scan(body, a[0], None, length=3)
    return jnp.sum(c ** 2)
  return jax.jit(jax.grad(scanned, argnums=argnums))


def _cases():
  """Every policy with ``jit(grad)``; every other program with the policy
  that splits ``fwd`` (where the crash was), and ``scan`` also with the one
  that recomputes."""
  out = []
  for name, rules in RULE_SETS.items():
    smart_kinds = ["smart"] + (["smart_fwd_bwd_only"] if rules[3] else [])
    for kind in smart_kinds:
      for policy in POLICIES:
        out.append((name, kind, policy, "jit_grad"))
      for program in ("eager_grad", "scan", "vmap_grad", "grad_of_grad"):
        out.append((name, kind, "save_only_r", program))
      out.append((name, kind, "nothing_saveable", "scan"))
  return out


def _run(kind, rules, policy, program):
  nargs = rules[0].__code__.co_argcount
  x = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
  w = jnp.linspace(0.5, 1.5, 3, dtype=jnp.float32)
  args = (x, w)[:nargs]
  if program == "vmap_grad":
    args = tuple(jnp.stack([a, a + 1.0]) for a in args)
  fn = _program(_build(kind, rules), nargs, POLICIES[policy], program)
  try:
    return fn(*args), None
  except Exception as e:  # noqa: BLE001 - compared by type below
    return None, e


def _jax_vmaps_checkpoint_name() -> bool:
  """jax 0.10.x under the remat3 flags cannot vmap ``checkpoint_name`` at all
  (its high-level primitive has no batching rule), in any program."""
  try:
    jax.vmap(lambda x: checkpoint_name(x, "r"))(jnp.ones((2, 3)))
    return True
  except NotImplementedError:
    return False


@pytest.mark.parametrize("name,kind,policy,program", _cases())
def test_matches_custom_vjp(name, kind, policy, program, ad_mode):
  rules = RULE_SETS[name]
  if (program == "vmap_grad" and name in ("forwarded_input", "repeated_output")
      and not _jax_vmaps_checkpoint_name()):
    pytest.skip(f"jax {jax.__version__} under {ad_mode} cannot vmap "
                "checkpoint_name (design/limitations.md)")
  got, got_err = _run(kind, rules, policy, program)
  ref, ref_err = _run("jax", rules, policy, program)
  if ref_err is not None:   # jax.custom_vjp fails on this JAX: the plain function
    ref, ref_err = _run("plain", rules, policy, program)
  if got_err is not None or ref_err is not None:
    assert type(got_err) is type(ref_err), (got_err, ref_err)
    return
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref),
                  strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_issue_repro_python_constant_under_checkpoint():
  """The report's program: a Python float among fwd's primal outputs."""
  @smartvjp.smart_custom_vjp
  def f(x):
    return jnp.sin(x), 0.0

  def fwd(x):
    return (jnp.sin(x), 0.0), jnp.cos(x)

  def bwd(c, g):
    return (c * g[0],)
  f.defvjp(fwd, bwd)
  x = jnp.arange(3.0)
  got = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(f)(x)[0] ** 2)))(x)
  np.testing.assert_allclose(got, 2 * jnp.sin(x) * jnp.cos(x), rtol=1e-6)
