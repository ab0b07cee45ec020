"""Every version flag (``smartvjp/_versions.py``): its value on each JAX that
CI runs, and a probe that the installed JAX behaves as the flag says.

The probes read JAX's internals or register a test primitive through
smartvjp's adapters (``smartvjp/_facade.py``), so that a JAX release that
moves a change fails here, naming the flag, instead of in a user's program.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from smartvjp import _facade, _versions

# every release CI installs, or installed: the whole suite runs on the newest
# of each minor version (0.10.2, 0.11.2, 0.12.1; 0.12.0.1 before 0.12.1 came
# out), the short jobs (this file) on the others
CI_VERSIONS = ("0.10.0", "0.10.1", "0.10.2", "0.11.0", "0.11.1", "0.11.2",
               "0.12.0", "0.12.0.1", "0.12.1")

# flag -> its value on each CI version, in CI_VERSIONS order
EXPECTED = {
    "EFFECTS_NAME_VARS":
        (False, False, True, True, True, True, True, True, True),
    "DISCHARGE_STATE_TAKES_CLOSED_JAXPR":
        (False, False, True, True, True, True, True, True, True),
    "CHECKIFY_TAKES_CTX":
        (False, False, False, False, False, True, True, True, True),
    "DISCHARGE_RULE_TAKES_CTX":
        (False, False, False, False, True, True, True, True, True),
    "REMAT3_RULE_GETS_TRACE":
        (False, False, False, True, True, True, True, True, True),
    "REMAT3_PERTURBS_EVERY_INPUT":
        (True, True, True, True, False, False, False, False, False),
    "HAS_CHECKPOINT_NAME_FWD":
        (False, False, False, False, False, True, True, True, True),
    "LINEARIZE_HAS_STRUCTURED_RES":
        (False, False, False, False, True, True, True, True, True),
    "TRANSPOSE_RETURNS_LOGS":
        (False, False, False, False, True, True, True, True, True),
    "DCE_RULE_TAKES_LIVE_INS":
        (False, False, False, False, False, False, True, True, True),
    "ALIASED_REFS_CHECKED_AT_CALL":
        (False, False, False, False, False, False, True, True, True),
    "REMAT3_RULE_RETURNS_RES":
        (False, False, False, False, False, False, True, True, True),
    "CUSTOM_VJP_METHODS_0_12":
        (False, False, False, False, False, False, True, True, True),
    "SHIPS_TRITON_PALLAS_OPS":
        (True, True, True, True, True, True, True, True, False),
}


def test_every_flag_is_in_the_table():
  assert set(EXPECTED) == set(_versions.FLAGS)


@pytest.mark.parametrize("flag", sorted(EXPECTED))
def test_flag_value_on_this_ci_combination(flag):
  if jax.__version__ not in CI_VERSIONS:
    pytest.skip(f"jax {jax.__version__} is not one of CI's {CI_VERSIONS}")
  expected = EXPECTED[flag][CI_VERSIONS.index(jax.__version__)]
  assert getattr(_versions, flag) is expected, (flag, jax.__version__)


# -- probes: the installed JAX behaves as each flag says --------------------------

def test_triton_pallas_ops():
  import importlib.util
  for name in ("attention", "layer_norm", "rms_norm"):
    found = importlib.util.find_spec(f"jax.experimental.pallas.ops.gpu.{name}")
    assert (found is not None) is _versions.SHIPS_TRITON_PALLAS_OPS, name

def _jax_src(name):
  import importlib
  return importlib.import_module(f"jax._src.{name}")


def test_effects_name_vars():
  core = _jax_src("core")

  def reads(r):
    return r[...] * 2.0
  jaxpr = jax.make_jaxpr(reads)(jax.new_ref(jnp.ones(3)))
  (effect,) = [e for e in jaxpr.effects
               if isinstance(e, _jax_src("effects").JaxprInputEffect)]
  assert hasattr(core, "positional_effects") is _versions.EFFECTS_NAME_VARS
  where = getattr(effect, "input", getattr(effect, "input_index", None))
  assert (not isinstance(where, int)) is _versions.EFFECTS_NAME_VARS


def test_discharge_signatures():
  discharge = _jax_src("state.discharge")
  assert ("closed_jaxpr" in inspect.signature(discharge.discharge_state)
          .parameters) is _versions.DISCHARGE_STATE_TAKES_CLOSED_JAXPR
  assert (hasattr(discharge, "DischargeContext")
          is _versions.DISCHARGE_RULE_TAKES_CTX)


def test_checkify_context():
  assert (hasattr(_jax_src("checkify"), "CheckifyContext")
          is _versions.CHECKIFY_TAKES_CTX)


def test_checkpoint_name_fwd():
  assert (hasattr(_jax_src("ad_checkpoint"), "CheckpointNameFwd")
          is _versions.HAS_CHECKPOINT_NAME_FWD)


def test_custom_vjp_methods():
  cv = _jax_src("custom_derivatives").custom_vjp
  assert hasattr(cv, "defvjp_with_logs") is _versions.TRANSPOSE_RETURNS_LOGS
  assert hasattr(_jax_src("interpreters.ad"), "_merge_rule_logs") \
      is _versions.TRANSPOSE_RETURNS_LOGS
  for method in ("defvjp_with_accums", "defremat", "defremat_with_logs"):
    assert hasattr(cv, method) is _versions.CUSTOM_VJP_METHODS_0_12
  assert ("generic_batching" in inspect.signature(cv.defvjp).parameters
          ) is _versions.CUSTOM_VJP_METHODS_0_12


def test_aliased_refs_checked_at_every_call():
  """Traced, undifferentiated: only where JAX checks at every call."""
  F = _jax_src("custom_derivatives").custom_vjp(lambda x, y: x[...] + y[...])
  F.defvjp(lambda x, y: (x[...] + y[...], None), lambda _, g: (g, g))
  r = jax.new_ref(jnp.ones(3))
  try:
    jax.make_jaxpr(lambda: F(r, r))()
    raised = False
  except ValueError:
    raised = True
  assert raised is _versions.ALIASED_REFS_CHECKED_AT_CALL


# A test primitive, the identity, whose rules go through smartvjp's
# adapters: a wrong flag makes JAX call them in the wrong form.
_probe_p = _facade.core.Primitive("versions_probe")
_probe_p.multiple_results = True
_probe_p.def_impl(lambda *xs: list(xs))
_probe_p.def_effectful_abstract_eval(lambda *avals: (list(avals), set()))
_facade.register_lowering(_probe_p, lambda *xs: list(xs))
_SEEN: list = []


def _probe_jvp(primals, tangents):
  _SEEN.append([type(t) is not _facade.ad_util.Zero for t in tangents])
  return _probe_p.bind(*primals), [_facade.ad.instantiate_zeros(t)
                                   for t in tangents]


_facade.ad.primitive_jvps[_probe_p] = _probe_jvp


def _probe_linearize(is_vjp, nonzeros, *primals):
  _SEEN.append(list(nonzeros))
  return (_probe_p.bind(*primals), list(nonzeros), [],
          lambda res, *tangents: list(tangents))


_facade.register_linearization(_probe_p, _probe_linearize)
_facade.ad.primitive_transposes[_probe_p] = lambda cts, *args: list(cts)
_facade.register_dce(_probe_p, lambda used, eqn: ([True] * len(eqn.invars),
                                                  eqn))


def _probe_remat3(ctx, *xs):
  outs = _probe_p.bind(*xs)
  return outs, (), lambda _res, *rem_in: _probe_p.bind(*rem_in)


_facade.register_remat3(_probe_p, _probe_remat3)


def test_linearization_adapter():
  g = jax.grad(lambda x: jnp.sum(_probe_p.bind(x)[0] * 3.0))(jnp.ones(2))
  np.testing.assert_allclose(g, [3.0, 3.0])


def test_dce_adapter():
  pe = _jax_src("interpreters.partial_eval")
  assert ("live_ins" in inspect.signature(pe._default_dce_rule).parameters
          ) is _versions.DCE_RULE_TAKES_LIVE_INS
  jaxpr = jax.make_jaxpr(lambda x: (_probe_p.bind(x)[0], x))(1.0).jaxpr
  kept, _ = pe.dce_jaxpr(jaxpr, [False, True])
  assert [e.primitive.name for e in kept.eqns] == ["versions_probe"]


def test_remat3_adapter_and_what_it_perturbs():
  if not (kernels.has_flag("jax_remat3") and kernels.has_flag("jax_custom_vjp3")):
    pytest.skip(f"jax {jax.__version__} has no jax_remat3")
  remat = _jax_src("interpreters.remat")
  assert ("custom_vjp_rules" in inspect.signature(remat.RematTrace.__init__)
          .parameters) is _versions.REMAT3_RULE_GETS_TRACE
  c = jnp.full((2,), 2.0)   # closed over, never differentiated
  _SEEN.clear()
  with kernels.config(jax_remat3=True, jax_custom_vjp3=True):
    g = jax.grad(lambda x: jnp.sum(jax.checkpoint(
        lambda x: _probe_p.bind(x, c)[0] * _probe_p.bind(x, c)[1])(x)))(
            jnp.ones(2))
  np.testing.assert_allclose(g, [2.0, 2.0])
  assert _SEEN, "the rem side was not differentiated (JVP or linearize)"
  # the closed-over c gets a tangent only where remat3 perturbs every input
  assert any(seen[1] for seen in _SEEN) is _versions.REMAT3_PERTURBS_EVERY_INPUT
