"""The opt-in check that f and fwd agree where both run (remat)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartvjp
from smartvjp import smart_custom_vjp
from test_higher_order import rules as higher_order_rules

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


def _with_fused(fused):
  """f = sin(x) * w with fwd/bwd right (test_higher_order's rules), and the
  given fwd_bwd."""
  f, fwd, bwd = higher_order_rules()

  @smart_custom_vjp
  def sin_fused(x, w):   # the name the errors give
    return f(x, w)

  sin_fused.defvjp(fwd, bwd, fwd_bwd=fused)
  return sin_fused


def _right_fused(x, w, g):
  return jnp.cos(x) * w * g, jnp.sum(jnp.sin(x) * g)


def _sin_bwd(c, g):
  return (c * g * 0.5,)


def _one_input(fused):
  """f = sin, fwd saving 2 cos(x), bwd(c, g) = c g / 2 (exactly cos(x) g,
  at a cost that makes the schedule pick fwd_bwd on either path), and the
  given fwd_bwd."""
  @smart_custom_vjp
  def sine(x):
    return jnp.sin(x)

  sine.defvjp(lambda x: (jnp.sin(x), 2 * jnp.cos(x)), _sin_bwd,
              fwd_bwd=fused)
  return sine


def _one_input_grad(F, jit=True, remat=True):
  body = jax.checkpoint(F) if remat else F
  grad = jax.grad(lambda x: jnp.sum(body(x) ** 2))
  return (jax.jit(grad) if jit else grad)(X)


def _fused_grad(F, jit=True, remat=True):
  body = jax.checkpoint(F) if remat else F
  grad = jax.grad(lambda x, w: jnp.sum(body(x, w) ** 2), argnums=(0, 1))
  return (jax.jit(grad) if jit else grad)(X, jnp.float32(1.5))


def _unfused_grad():
  return _fused_grad(_with_fused(None), remat=False)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_fwd_bwd_is_checked_against_bwd_after_fwd(ad_mode, jit):
  """Issue 65 item 2: a fwd_bwd written with bwd's signature by mistake
  changes the gradient under jax.checkpoint only, silently; check_primals
  compares it with bwd(fwd(*args)[1], g), raising (under jit, JAX's runtime
  error carrying our message) or warning, with its tolerances."""
  del ad_mode
  wrong = _one_input(_sin_bwd)   # fwd_bwd(x, g) given bwd(c, g): c is x
  got = _one_input_grad(wrong, jit)
  want = _one_input_grad(_one_input(None), remat=False)
  np.testing.assert_allclose(want, 2 * np.sin(X) * np.cos(X), rtol=1e-5)
  assert not np.allclose(got, want)   # the silent wrong gradient
  np.testing.assert_allclose(   # without remat, fwd and bwd run: right
      _one_input_grad(wrong, jit, remat=False), want, rtol=1e-6)
  with smartvjp.check_primals("raise"):
    with pytest.raises(Exception, match=(
        r"fwd_bwd \(_sin_bwd\) and bwd \(_sin_bwd\) after fwd "
        r"\(<lambda>\) disagree at the cotangent of input leaf 0 of "
        r"sine")) as e:
      jax.block_until_ready(_one_input_grad(wrong, jit))
      jax.effects_barrier()
  if not jit:
    assert type(e.value) is smartvjp.PrimalMismatchError
  with smartvjp.check_primals("warn"):
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      seen = jax.block_until_ready(_one_input_grad(wrong, jit))
      jax.effects_barrier()
  assert any("input leaf 0" in str(x.message) for x in w)
  # the check only observes: the gradient is still fwd_bwd's
  np.testing.assert_array_equal(seen, got)
  # fwd_bwd may be off by less than the tolerances
  off = _one_input(lambda x, g: (jnp.cos(x) * g + 1e-3,))
  with smartvjp.check_primals("raise", rtol=0.0, atol=1e-2):
    jax.block_until_ready(_one_input_grad(off, jit))
    jax.effects_barrier()
  with smartvjp.check_primals("raise", rtol=0.0, atol=1e-4):
    with pytest.raises(Exception, match="input leaf 0"):
      jax.block_until_ready(_one_input_grad(off, jit))
      jax.effects_barrier()


def test_a_right_fwd_bwd_passes_and_the_global_setting_checks_it(ad_mode):
  """Two inputs, the second's cotangent wrong; only where fwd_bwd runs (under
  the remat3 flags this call's schedule runs fwd and bwd instead, and the
  gradient is right)."""
  del ad_mode
  right = _with_fused(_right_fused)
  with smartvjp.check_primals("raise"):
    got = _fused_grad(right)
    jax.effects_barrier()
  np.testing.assert_allclose(got[0], _unfused_grad()[0], rtol=1e-6)
  wrong = _with_fused(lambda x, w, g: (jnp.cos(x) * w * g, jnp.sum(g)))
  runs_fused = not np.allclose(_fused_grad(wrong)[1], _unfused_grad()[1])
  try:
    jax.config.update("smartvjp_check_primals", "raise:0:1e-6")
    if runs_fused:
      with pytest.raises(Exception, match="input leaf 1 of sin_fused"):
        jax.block_until_ready(_fused_grad(wrong))
        jax.effects_barrier()
    else:
      jax.block_until_ready(_fused_grad(wrong))
      jax.effects_barrier()
  finally:
    jax.config.update("smartvjp_check_primals", None)
  assert runs_fused or jax.config.read("jax_remat3")


def test_fwd_bwd_alone_has_nothing_to_check_against():
  F = smart_custom_vjp(lambda x: jnp.sin(x))
  F.defvjp(fwd_bwd=lambda x, g: (jnp.cos(x) * g,))
  with smartvjp.check_primals("raise"):
    g = jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x)))(X)
    jax.effects_barrier()
  np.testing.assert_allclose(g, jnp.cos(X), rtol=1e-6)
