"""The audit's words and forms (issue 68, "Why" 9): what it says where a
configuration was not asked for, a count that does not exist, the HTML
table's line breaks, an effect in ``f`` that breaks the swapped step, and
``measure=True`` where there is nothing to time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import kernels as K
import smartvjp
from smartvjp.audit import _report


def _sin_site(never_dce=True):
  f, fwd, bwd, _ = K.sin_rules(never_dce)
  F = jax.custom_vjp(f)
  F.defvjp(fwd, bwd)
  return F


def _step(F):
  def step(x, ws):
    layer = lambda c, w: (F(c * w), None)
    loss = lambda x, ws: jnp.sum(
        jax.lax.scan(jax.checkpoint(layer), x, ws)[0] ** 2)
    return jax.grad(loss)(x, ws)
  return step, (jnp.ones((4, 8)), jnp.full((3, 4, 8), 0.5))


def test_assert_no_duplicate_fwd_does_not_claim_a_failed_configuration():
  step, args = _step(_sin_site())
  with pytest.raises(AssertionError):
    smartvjp.audit.assert_no_duplicate_fwd(step, *args)
  a = smartvjp.audit._audit.analyse(step, args, {}, configs=("as_is",))[0]
  (s,) = a["sites"]
  assert a["errors"] == {}
  assert "did not trace" not in s["suggestion"]
  assert s["suggestion"].startswith("no suggestion: this audit compiled only "
                                    "as_is")


def test_runs_names_the_counts_it_has():
  step, args = _step(_sin_site())
  a = smartvjp.audit(step, *args, configs=("as_written", "smartvjp"))
  with pytest.raises(KeyError, match="'compiled'.*'jaxpr'"):
    a.runs("as_written", "hlo")
  with pytest.raises(KeyError, match="no counts"):
    a.runs("optimize_remat")
  assert a.runs("as_written", "jaxpr")


def test_the_html_table_breaks_between_the_parts_of_a_name():
  step, args = _step(_sin_site())
  page = smartvjp.audit(step, *args, configs=("as_written", "smartvjp")
                        ).to_html()
  assert "overflow-wrap:anywhere" not in page and "word-break:break-all" \
      not in page
  assert "<code>kernels.<wbr>f</code>" in page
  assert _report._breakable("a.b/c › d") == "a.<wbr>b/<wbr>c ›<wbr> d"


def _io_in_f():
  @jax.custom_vjp
  def F(x):
    return io_callback(lambda x: np.sin(x), jax.ShapeDtypeStruct(
        x.shape, x.dtype), x)
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  return F


def test_an_effect_in_f_is_a_hazard_and_measure_returns_the_report():
  step, args = _step(_io_in_f())
  # the swapped step really fails: JAX cannot differentiate an effect
  # under checkpoint, where the swap runs f
  a = smartvjp.audit(step, *args, measure=True,
                     configs=("as_written", "smartvjp"))
  assert "smartvjp" in a.data["errors"]
  (s,) = a.sites
  assert any(h.startswith("f has effects") for h in s["hazards"])
  assert s["runs"]["smartvjp"] is None
  assert s["suggestion"].startswith("no suggestion: a configuration did not "
                                    "trace")
  # the measurement says why it has no saving, and the report is whole
  assert a.measured["paired_ratio"] is None and a.measured["error"]
  assert "measured: " + a.measured["summary"] in a.table()
