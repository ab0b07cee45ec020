"""Effects: debug prints/callbacks inside f, fwd or bwd do not change which
rule runs where (optimize_remat=True silently stops rematerializing when fwd
has one); ordered effects that cannot be rematerialized raise, as in JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import kernels as K
from smartvjp import smart_custom_vjp

X = jnp.array([0.3, -1.2, 2.0], jnp.float32)


def with_prints(where):
  f, fwd, bwd, _ = K.sin_rules()
  seen = []

  def note(name):
    def cb(*_):
      seen.append(name)
    return cb

  def pf(x):
    if "f" in where:
      jax.debug.print("f {}", x[0])
    return f(x)

  def pfwd(x):
    if "fwd" in where:
      jax.debug.callback(note("fwd"), x)
    return fwd(x)

  def pbwd(res, g):
    if "bwd" in where:
      jax.debug.callback(note("bwd"), g)
    return bwd(res, g)

  return pf, pfwd, pbwd, seen


@pytest.mark.parametrize("where", [("f",), ("fwd",), ("bwd",), ("f", "fwd", "bwd")])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_debug_effects_do_not_move_rules(ad_mode, where, remat):
  pf, pfwd, pbwd, seen = with_prints(where)
  F = smart_custom_vjp(pf)
  F.defvjp(pfwd, pbwd)
  G = jax.checkpoint(F) if remat else F
  K.reset()
  g = jax.jit(jax.grad(lambda x: jnp.sum(G(x) ** 2)))(X)
  jax.effects_barrier()
  expected = {"fwd": 1, "bwd": 1}
  if remat:
    expected["f"] = 1
  assert dict(K.COUNTS) == expected
  np.testing.assert_allclose(g, 2 * np.sin(X) * np.cos(X), rtol=1e-6)
  assert seen.count("fwd") == ("fwd" in where)
  assert seen.count("bwd") == ("bwd" in where)


def test_optimize_remat_stops_rematerializing_with_debug_in_fwd():
  pf, pfwd, pbwd, _ = with_prints(("fwd",))
  O = jax.custom_vjp(pf)
  O.defvjp(pfwd, pbwd, optimize_remat=True)
  K.reset()
  jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(O)(x) ** 2)))(X)
  jax.effects_barrier()
  assert dict(K.COUNTS) == {"fwd": 1, "bwd": 1}   # residuals saved, not remat


def test_ordered_effects_cannot_be_rematerialized():
  def f(x):
    io_callback(lambda x: None, None, x, ordered=True)
    return jnp.sin(x)

  F = smart_custom_vjp(f)
  F.defvjp(lambda x: (f(x), jnp.cos(x)), lambda c, g: (c * g,))
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(F(x)))(X), np.cos(X),
                             rtol=1e-6)
  with pytest.raises(NotImplementedError, match="Effects not supported"):
    jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x)))(X)


# -- debug effects run at least once wherever jax.custom_vjp runs them --------

def _counting_rules(where, seed):
  """sin with a debug callback in ``where``; ``seed``: fwd's residual is x."""
  seen = []

  def f(x):
    if where == "f":
      jax.debug.callback(lambda *_: seen.append("f"), x)
    return jnp.sin(x)

  def fwd(x):
    if where == "fwd":
      jax.debug.callback(lambda *_: seen.append("fwd"), x)
    return jnp.sin(x), (x if seed else jnp.cos(x))

  def bwd(r, g):
    if where == "bwd":
      jax.debug.callback(lambda *_: seen.append("bwd"), g)
    return ((jnp.cos(r) if seed else r) * g,)
  return f, fwd, bwd, seen


def _effect_program(F, used, jit, remat, grad):
  G = jax.checkpoint(F) if remat else F
  if grad and used:
    fn = jax.grad(lambda x: jnp.sum(G(x) ** 2))
  elif grad:   # the call is differentiated, its output then thrown away
    fn = jax.grad(lambda x: jnp.sum(x ** 2)
                  + 0 * jnp.sum(jax.lax.stop_gradient(G(x))))
  elif used:
    fn = lambda x: G(x) * 2
  else:
    fn = lambda x: (G(x), x * 2)[1]
  return jax.jit(fn) if jit else fn


def _prints(make, where, seed, used, jit, remat, grad):
  f, fwd, bwd, seen = _counting_rules(where, seed)
  F = make(f)
  F.defvjp(fwd, bwd)
  out = _effect_program(F, used, jit, remat, grad)(X)
  jax.block_until_ready(out)
  jax.effects_barrier()
  return len(seen), out


@pytest.mark.parametrize("grad", [False, True], ids=["nograd", "grad"])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("used", [True, False], ids=["used", "unused"])
@pytest.mark.parametrize("seed", [False, True], ids=["res", "res_is_x"])
@pytest.mark.parametrize("where", ["f", "fwd", "bwd"])
def test_debug_effects_run_as_with_custom_vjp(where, seed, used, jit, remat,
                                              grad):
  """A print that jax.custom_vjp runs at least once runs at least once, and
  never more often than there, except under checkpoint with grad, where the
  contract runs f once in the forward pass (jax.custom_vjp: never) and fwd
  once in the backward region (jax.custom_vjp: twice)."""
  args = (where, seed, used, jit, remat, grad)
  want, want_out = _prints(jax.custom_vjp, *args)
  got, out = _prints(smart_custom_vjp, *args)
  np.testing.assert_allclose(out, want_out, rtol=1e-6)
  if remat and grad and where in ("f", "fwd"):
    want = 1
  assert got == want


@pytest.mark.parametrize("with_fwd", [True, False], ids=["fwd_bwd_too", "fwd_bwd_only"])
def test_print_in_f_with_fused_rule_under_checkpoint_runs_twice(with_fwd):
  """design/limitations.md ("Debug effects under checkpoint"): with fwd_bwd,
  the rematerialized f is dead but kept for its effect, as in a plain
  checkpointed function; f 1 where it has no effect (test_contract.py)."""
  seen = []

  def f(x):
    jax.debug.callback(lambda: seen.append("f"))
    return jnp.sin(x)

  F = smart_custom_vjp(f)
  fwd_bwd = lambda x, g: (g * jnp.cos(x),)
  if with_fwd:
    F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,),
             fwd_bwd=fwd_bwd)
  else:
    F.defvjp(fwd_bwd=fwd_bwd)

  def plain(x):
    jax.debug.callback(lambda: seen.append("plain"))
    return jnp.sin(x)

  for fn in (F, plain):
    g = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(fn)(x))))(X)
    jax.effects_barrier()
    np.testing.assert_allclose(g, np.cos(X), rtol=1e-6)
  assert seen.count("f") == seen.count("plain") == 2


# -- an equation with no outputs under a policy that saves (issue 56) ---------

_SAVING = {
    "dots": jax.checkpoint_policies.dots_saveable,
    "everything": jax.checkpoint_policies.everything_saveable,
    "names": jax.checkpoint_policies.save_only_these_names("y"),
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _matmul_with_callbacks(make, where, seen):
  def note(name):
    return lambda: seen.append(name)

  def f(x, w):
    if where == "f":
      jax.debug.callback(note("f"))
    return jnp.tanh(x @ w)

  def fwd(x, w):
    if where == "fwd":
      jax.debug.callback(note("fwd"))   # an equation with no outputs
    y = jax.ad_checkpoint.checkpoint_name(x @ w, "y")
    return jnp.tanh(y), (x, w, y)

  def bwd(res, g):
    x, w, y = res
    if where == "bwd":
      jax.debug.callback(note("bwd"))
    g = g * (1 - jnp.tanh(y) ** 2)
    return g @ w.T, x.T @ g

  F = make(f)
  F.defvjp(fwd, bwd)
  return F


@pytest.mark.parametrize("policy", sorted(_SAVING))
@pytest.mark.parametrize("where", ["f", "fwd", "bwd"])
def test_effect_without_outputs_under_saving_policy(ad_mode, where, policy):
  """jax.custom_vjp runs these; smartvjp read every equation's first output
  in the policy's split of fwd (IndexError on a callback)."""
  x = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) / 7
  w = jnp.eye(3, dtype=jnp.float32) + 0.25
  grads = []
  for make in (jax.custom_vjp, smart_custom_vjp):
    seen = []
    F = _matmul_with_callbacks(make, where, seen)
    G = jax.checkpoint(F, policy=_SAVING[policy])
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(G(x, w) ** 2), (0, 1)))(x, w)
    jax.effects_barrier()
    grads.append(g)
    assert where == "f" or seen.count(where) >= 1
  for a, b in zip(*grads):
    np.testing.assert_array_equal(a, b)
