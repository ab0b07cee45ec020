"""``smartvjp/_jaxprs.py``: the one sub-jaxpr walker and what it reads.

The walker's kernels and trip counts are tested with the audit's prices
(``tests/test_audit_pricing.py``); here, the plan's operation count (a
``fold``) as a table, and the readers that came to the walker last: the
axis names of ``unjustified_invariance``, which now see a remat3
checkpoint's jaxpr."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import kernels
from smartvjp import _jaxprs

X = jnp.ones((4, 3), jnp.float32)
W = jnp.ones((3, 5), jnp.float32)


def _two_outputs(x):
  shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2
  return jax.pure_callback(lambda a: (np.sin(a), np.cos(a)), shapes, x)


# (program of X, operations): a dot_general its multiply-adds (2 * 4*5 * 3),
# anything else its outputs' elements, loops per trip, a cond's costliest
# branch, a checkpoint_name nothing, a kernel with two outputs unbounded
OPERATIONS = [
    ("matmul", lambda x: x @ W, 2.0 * 20 * 3),
    ("sin", jnp.sin, 12.0),
    ("jit", lambda x: jax.jit(lambda y: jnp.sin(jnp.cos(y)))(x), 24.0),
    ("scan", lambda x: jax.lax.scan(lambda c, _: (jnp.sin(c), None), x,
                                    None, length=5)[0], 60.0),
    ("cond", lambda x: jax.lax.cond(True, lambda y: jnp.sin(jnp.cos(y)),
                                    jnp.sin, x), 24.0),
    ("checkpoint_name", lambda x: jax.ad_checkpoint.checkpoint_name(x, "a"),
     0.0),
    ("two-output kernel", lambda x: _two_outputs(x)[0], math.inf),
    ("two-output kernel in a branch",
     lambda x: jax.lax.cond(True, lambda y: _two_outputs(y)[0], jnp.sin, x),
     math.inf),
]


@pytest.mark.parametrize("program, ops", [o[1:] for o in OPERATIONS],
                         ids=[o[0] for o in OPERATIONS])
def test_operation_count_is_a_fold(program, ops):
  closed = jax.make_jaxpr(program)(X)
  # the scan's and cond's own outputs are not counted: their bodies are
  assert _jaxprs.operation_count(closed) == ops
  assert _jaxprs.operation_count(closed.jaxpr.eqns) == ops


def test_is_multi_output_kernel():
  eqns = jax.make_jaxpr(lambda x: (_two_outputs(x), jax.pure_callback(
      np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)))(X).jaxpr.eqns
  assert [_jaxprs.is_opaque_kernel(e) for e in eqns] == [True, True]
  assert [_jaxprs.is_multi_output_kernel(e) for e in eqns] == [True, False]


def _shard_mapped_body(body):
  mesh = jax.make_mesh((1,), ("x",))
  f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P(),
                    check_vma=True)
  x = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("x")))
  return jax.make_jaxpr(f)(x).jaxpr.eqns[0].params["jaxpr"]


def test_axis_names_are_read_inside_a_checkpoint(ad_mode):
  """A ``psum`` inside ``jax.checkpoint`` makes its output invariant along
  ``x`` honestly; under the remat3 flags the checkpoint is a high-level
  primitive whose jaxpr only the walker (``_prim``) reaches."""
  body = _shard_mapped_body(
      lambda x: jax.checkpoint(lambda y: jax.lax.psum(y, "x"))(x))
  if ad_mode == "remat3":
    assert _jaxprs.jx.high_level_jaxprs(body.eqns[0])
  assert _jaxprs.unjustified_invariance(body) == [frozenset()]


def test_a_callbacks_invariant_result_is_still_unjustified(ad_mode):
  def body(x):
    y = jax.checkpoint(lambda y: jax.pure_callback(
        np.sin, jax.ShapeDtypeStruct((), y.dtype), y.sum()))(x)
    return y
  assert _jaxprs.unjustified_invariance(_shard_mapped_body(body)) == [
      frozenset({"x"})]


def test_a_registered_primitive_is_an_opaque_kernel():
  """The tests' never-DCE'd kernel primitive (``register_opaque_kernel``)."""
  (eqn,) = jax.make_jaxpr(lambda x: kernels.kernel(
      "k", lambda a: (np.sin(a),), [x], x, never_dce=True))(X).jaxpr.eqns
  assert eqn.primitive.name == "test_opaque_kernel"
  assert _jaxprs.is_opaque_kernel(eqn) and not _jaxprs.inner_jaxprs(eqn)
