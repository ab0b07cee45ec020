"""Every difference between the supported JAX releases (0.10.x to 0.12.x),
one flag each, named after the release that changed the behaviour;
``tests/test_versions.py`` asserts each flag on every release CI installs
and probes that JAX behaves as it says."""

from __future__ import annotations

import jax

JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__)


def _since(*release: int) -> bool:
  return JAX_VERSION[:len(release)] >= release


# -- jax 0.10.2 -----------------------------------------------------------------

# An effect on a jaxpr input (a reference read or written) names the input's
# Var inside a jaxpr and its position in what an abstract evaluation rule
# returns (core.positional_effects); before, it held a position everywhere.
EFFECTS_NAME_VARS = _since(0, 10, 2)

# state.discharge.discharge_state takes a ClosedJaxpr and returns one; before,
# (jaxpr, consts) in and out.
DISCHARGE_STATE_TAKES_CLOSED_JAXPR = _since(0, 10, 2)

# -- jax 0.11.0 -----------------------------------------------------------------

# remat3 rules receive the RematTrace (policy in trace.policy, and
# trace.custom_vjp_rules); 0.10.x passed the policy itself.
REMAT3_RULE_GETS_TRACE = _since(0, 11, 0)

# -- jax 0.11.1 -----------------------------------------------------------------

# remat3 differentiates the rematerialized region with respect to every input
# of the checkpoint, values its body closes over included, until 0.11.1;
# from 0.11.1 only with respect to the checkpoint's perturbed inputs.
REMAT3_PERTURBS_EVERY_INPUT = not _since(0, 11, 1)

# The backward pass collects backward-pass logs (VJP.with_logs) from
# ad.fancy_transposes, whose rules get gradient accumulators and return None
# or a dict; jax.custom_vjp.defvjp_with_logs exists.
TRANSPOSE_RETURNS_LOGS = _since(0, 11, 1)

# State discharge rules take a DischargeContext (with should_discharge)
# first; before, (in_avals, out_avals).
DISCHARGE_RULE_TAKES_CTX = _since(0, 11, 1)

# A linearization rule returns five values (primal_out, tangent_nzs_out,
# residuals, structured_res, linearized), linearized called as
# linearized(residuals, structured_res_binders, *tangents); before, four and
# linearized(residuals, *tangents).
LINEARIZE_HAS_STRUCTURED_RES = _since(0, 11, 1)

# -- jax 0.11.2 -----------------------------------------------------------------

# checkify rules and checkify_jaxpr_flat take a leading CheckifyContext.
CHECKIFY_TAKES_CTX = _since(0, 11, 2)

# Under remat3, checkpoint_name inside a custom_vjp fwd binds the high-level
# CheckpointNameFwd (beside CheckpointName).
HAS_CHECKPOINT_NAME_FWD = _since(0, 11, 2)

# -- jax 0.12.0 -----------------------------------------------------------------

# DCE rules are called as rule(used_outs, live_ins, eqn); before,
# rule(used_outs, eqn).
DCE_RULE_TAKES_LIVE_INS = _since(0, 12, 0)

# jax.custom_vjp refuses two differentiable arguments that are the same
# mutable array at every call; before, only when fwd runs.
ALIASED_REFS_CHECKED_AT_CALL = _since(0, 12, 0)

# remat3 rules return (primal_out, residuals, rem), rem called as
# rem(residuals, *rem_inputs); before, (primal_out, rem) and rem(*rem_inputs).
REMAT3_RULE_RETURNS_RES = _since(0, 12, 0)

# jax.custom_vjp gains defvjp_with_accums, defremat, defremat_with_logs and
# defvjp's generic_batching parameter (JAX's own introduction releases are
# in _jax_api.INTRODUCED).
CUSTOM_VJP_METHODS_0_12 = _since(0, 12, 0)

# -- jax 0.12.1 -----------------------------------------------------------------

# jax.experimental.pallas.ops.gpu ships the Triton-lowered kernels attention,
# layer_norm and rms_norm (jax.custom_vjp functions) until 0.12.0.x; 0.12.1
# removed them (the Mosaic GPU *_mgpu kernels remain). Read by the examples
# and tests that swap JAX's shipped kernels, not by smartvjp itself.
SHIPS_TRITON_PALLAS_OPS = not _since(0, 12, 1)

FLAGS = (
    "EFFECTS_NAME_VARS", "DISCHARGE_STATE_TAKES_CLOSED_JAXPR",
    "CHECKIFY_TAKES_CTX", "DISCHARGE_RULE_TAKES_CTX", "REMAT3_RULE_GETS_TRACE",
    "REMAT3_PERTURBS_EVERY_INPUT", "HAS_CHECKPOINT_NAME_FWD",
    "LINEARIZE_HAS_STRUCTURED_RES", "TRANSPOSE_RETURNS_LOGS",
    "DCE_RULE_TAKES_LIVE_INS", "ALIASED_REFS_CHECKED_AT_CALL",
    "REMAT3_RULE_RETURNS_RES", "CUSTOM_VJP_METHODS_0_12",
    "SHIPS_TRITON_PALLAS_OPS")
