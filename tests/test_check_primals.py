"""The opt-in check that f and fwd agree where both run (remat)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartvjp
from smartvjp import smart_custom_vjp

X = jnp.array([0.3, -1.2, 2.0], jnp.float32)


def make(offset):
  @smart_custom_vjp
  def f_inference(x):
    return jnp.sin(x)

  def fwd_training(x):
    return jnp.sin(x) + offset, jnp.cos(x)

  f_inference.defvjp(fwd_training, lambda c, g: (c * g,))
  return f_inference


def remat_grad(F):
  return jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x) ** 2)))


def test_off_by_default_and_quiet_when_equal():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    remat_grad(make(0.5))(X).block_until_ready()   # off: no check
    with smartvjp.check_primals("raise"):
      remat_grad(make(0.0))(X).block_until_ready()


def test_raise_names_both_rules():
  with smartvjp.check_primals("raise", rtol=1e-6, atol=1e-6):
    with pytest.raises(Exception, match=r"f \(f_inference\) and fwd "
                       r"\(fwd_training\) disagree"):
      remat_grad(make(1e-3))(X).block_until_ready()
      jax.effects_barrier()


def test_warn_and_tolerance():
  with smartvjp.check_primals("warn", rtol=0.0, atol=1e-2):
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      remat_grad(make(1e-3))(X).block_until_ready()   # within atol
      jax.effects_barrier()
      assert not w
      g = remat_grad(make(1.0))(X)
      jax.effects_barrier()
      assert any("disagree" in str(x.message) for x in w)
  # the check only observes: the loss saw f's value (sin), bwd fwd's residual
  np.testing.assert_allclose(g, 2 * np.sin(X) * np.cos(X), rtol=1e-5)


def test_global_option_and_bad_values():
  jax.config.update("smartvjp_check_primals", "raise:0:1e-9")
  try:
    with pytest.raises(Exception, match="disagree"):
      remat_grad(make(1e-3))(X).block_until_ready()
      jax.effects_barrier()
  finally:
    jax.config.update("smartvjp_check_primals", None)
  with pytest.raises(ValueError, match="must be 'off', 'warn' or 'raise'"):
    smartvjp.check_primals("loud")   # refused at once, not only on entry
  with pytest.raises(ValueError, match="must be 'off', 'warn' or 'raise'"):
    jax.config.update("smartvjp_check_primals", "loud")
    try:
      remat_grad(make(0.0))(X)
    finally:
      jax.config.update("smartvjp_check_primals", None)


def test_complex_outputs_are_compared_in_full():
  @smart_custom_vjp
  def f_c(x):
    return x * 1j

  f_c.defvjp(lambda x: (x * 2j, jnp.ones_like(x)), lambda r, g: (g * r,))
  with smartvjp.check_primals("raise"):
    with pytest.raises(Exception, match="disagree"):
      jax.grad(lambda x: jnp.sum(jax.checkpoint(f_c)(x)).real)(
          jnp.ones(2, jnp.complex64))
      jax.effects_barrier()


def test_prng_key_outputs_are_compared_by_key_data():
  @smart_custom_vjp
  def f_key(x, k):
    return x * jax.random.normal(k, x.shape), jax.random.split(k)[0]

  def fwd(x, k):
    n = jax.random.normal(k, x.shape)
    return (x * n, jax.random.split(k)[0]), (n,)

  f_key.defvjp(fwd, lambda r, g: (g[0] * r[0], None))
  k = jax.random.key(0)
  with smartvjp.check_primals("raise"):
    g = jax.grad(lambda x: jnp.sum(jax.checkpoint(f_key)(x, k)[0]))(X)
    jax.effects_barrier()
  np.testing.assert_allclose(g, jax.random.normal(k, X.shape), rtol=1e-6)


def test_a_jitted_function_traced_before_the_check_is_traced_again():
  """The option is part of jax.jit's cache key: a function compiled without
  the check is not reused inside ``with check_primals(...)`` (and back)."""
  grad = remat_grad(make(1.0))
  grad(X).block_until_ready()
  with smartvjp.check_primals("raise"):
    with pytest.raises(Exception, match="disagree"):
      grad(X).block_until_ready()
      jax.effects_barrier()
  grad(X).block_until_ready()   # the unchecked compilation again: no error
  jax.effects_barrier()


def test_only_where_remat_runs_both(caplog):
  wrong = make(0.5)
  plain = jax.jit(jax.grad(lambda x: jnp.sum(wrong(x) ** 2)))
  saved = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(
      wrong, policy=jax.checkpoint_policies.everything_saveable)(x) ** 2)))
  with smartvjp.check_primals("raise"):
    # fwd alone runs (as with jax.custom_vjp): f's value is never used
    plain(X).block_until_ready()
    saved(X).block_until_ready()
    # eagerly, under remat: the check's own error, at once, nothing logged
    with pytest.raises(smartvjp.PrimalMismatchError, match="disagree"):
      jax.grad(lambda x: jnp.sum(jax.checkpoint(wrong)(x) ** 2))(X)
  assert "callback" not in caplog.text
