"""Every rule of every smartvjp primitive, registered in one block per primitive.

The rules themselves live with the machinery they serve (``_primitives.py``:
evaluation, abstract evaluation, DCE, printing, state discharge; ``_ad.py``:
JVP, linearization, transposition; ``_partial_eval.py``; ``_batching.py``;
``_checkify.py``). This module is where a reader finds, for one primitive,
all of them; ``design/architecture.md`` has the same table with file and
function, and ``tests/test_architecture.py`` keeps the two equal.
"""

from __future__ import annotations

from smartvjp import _ad, _batching, _checkify, _jax_api, _partial_eval, _remat3
from smartvjp import _primitives as P
from smartvjp._compat import register_rules

# smartvjp_call: evaluates f.
register_rules(
    P.call_p,
    impl=P.call_eval, abstract_eval=P._call_abstract_eval,
    lowering=P.call_eval,
    jvp=_ad._call_jvp, linearization=_ad._call_linearize,
    transpose=_ad._call_transpose,
    dce=P._dce_call, batching=_batching._call_batch, pp=P._pp_rule,
    checkify=_checkify._call_checkify, discharge=P._call_discharge,
    remat3=_remat3._call_remat3)

# smartvjp_primal: f where a differentiated call needs only its primal
# outputs; differentiated as fwd's code.
register_rules(
    P.primal_p,
    impl=P.primal_eval, abstract_eval=P._primal_abstract_eval,
    lowering=P.primal_eval,
    jvp=_ad._primal_jvp,
    dce=P._dce_whole, batching=_batching._primal_batch, pp=P._pp_rule,
    checkify=_checkify._primal_checkify, discharge=P._primal_discharge)

# smartvjp_fwd: evaluates fwd (primal outputs and the residuals that are not
# inputs).
register_rules(
    P.fwd_p,
    impl=P.fwd_eval, abstract_eval=P._fwd_abstract_eval,
    lowering=P.fwd_eval,
    jvp=_ad._fwd_jvp,
    dce=P._dce_fwd, batching=_batching._fwd_batch, pp=P._pp_rule,
    checkify=_checkify._fwd_checkify, discharge=P._fwd_discharge)

# smartvjp_jvp: primal and tangent outputs together (what jax.checkpoint
# and jax.jvp see); partial eval decides where fwd runs.
register_rules(
    P.jvp_p,
    impl=_ad._jvp_forward, abstract_eval=P._jvp_abstract_eval,
    lowering=_ad._jvp_forward,
    jvp=_ad._jvp_of_smartvjp_jvp,
    discharge=_ad._discharge_by_tracing(_ad._jvp_forward, "smartvjp_jvp"),
    partial_eval=_partial_eval._jvp_partial_eval,
    partial_eval_custom=_partial_eval._jvp_partial_eval_custom,
    dce=P._dce_jvp, batching=_batching._jvp_batch, pp=P._pp_rule,
    checkify=_checkify._forward_mode_checkify(_ad._jvp_forward,
                                              _checkify._jvp_which))

# smartvjp_lin: linear in the tangents, from fwd's residuals; its transpose
# runs bwd.
register_rules(
    P.lin_p,
    impl=_ad._lin_forward, abstract_eval=P._lin_abstract_eval,
    lowering=_ad._lin_forward,
    jvp=_ad._lin_jvp, transpose=_ad._lin_transpose,
    transpose_with_logs=(_ad._lin_transpose, _jax_api.collecting_logs,
                         _jax_api.merged_logs),
    discharge=_ad._discharge_by_tracing(_ad._lin_forward, "smartvjp_lin"),
    dce=P._dce_whole, batching=_batching._lin_batch, pp=P._pp_rule,
    checkify=_checkify._forward_mode_checkify(_ad._lin_forward,
                                              _checkify._lin_which))

# smartvjp_fused_lin: linear in the tangents, from the primal inputs; its
# transpose runs fwd_bwd.
register_rules(
    P.fused_lin_p,
    impl=_ad._fused_lin_forward, abstract_eval=P._lin_abstract_eval,
    lowering=_ad._fused_lin_forward,
    jvp=_ad._fused_lin_jvp, transpose=_ad._fused_lin_transpose,
    transpose_with_logs=(_ad._fused_lin_transpose, _jax_api.collecting_logs,
                         _jax_api.merged_logs),
    discharge=_ad._discharge_by_tracing(_ad._fused_lin_forward,
                                        "smartvjp_fused_lin"),
    dce=P._dce_whole, batching=_batching._fused_lin_batch, pp=P._pp_rule,
    checkify=_checkify._forward_mode_checkify(_ad._fused_lin_forward,
                                              _checkify._fused_lin_which))

# smartvjp_bwd: a backward rule, bwd or fwd_bwd, traced when the transpose
# runs.
register_rules(
    P.bwd_p,
    impl=P.bwd_eval, abstract_eval=P._bwd_abstract_eval,
    lowering=P.bwd_eval,
    jvp=_ad._bwd_jvp, transpose=_ad._bwd_transpose,
    dce=P._dce_whole, batching=_batching._bwd_batch, pp=P._pp_rule,
    checkify=_checkify._bwd_checkify, discharge=P._bwd_discharge,
    to_lojax=_remat3._bwd_to_lojax)

# smartvjp_rem: the rematerialized side of a call under jax_remat3 (what the
# backward region differentiates); its derivative is smartvjp_jvp's.
register_rules(
    _remat3.rem_p,
    impl=_remat3._rem_eval, abstract_eval=_remat3._rem_abstract_eval,
    lowering=_remat3._rem_eval,
    jvp=_remat3._rem_jvp, dce=_remat3._rem_dce, pp=_remat3._rem_pp,
    batching=_remat3._rem_batch, discharge=_remat3._rem_discharge,
    remat3=_remat3._rem_remat3)
