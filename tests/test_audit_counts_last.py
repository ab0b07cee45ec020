"""The audit's last count errors (issue 68, "Why" 8), each against host
counters inside the kernels, run in the executables the audit compiled:

* a kernel in a ``while_loop`` inside ``fwd`` (jaxpr ``fwd 5`` where 4 ran:
  JAX's lazy trace of ``fwd`` under ``scan`` stages the loop, unread, at
  the top level);
* a loop-invariant piece of ``fwd`` moved out of the scan (brainstate's
  embedding, diffrax: ``fwd 9`` for 8);
* a rule with no operations (optax's ``scale_gradient``: "no work", not
  ``f 0, fwd 0``);
* LAPACK custom calls in a JAX-coded rule (meent's ``eig``: compiled ``bwd
  12`` for 4; ``jnp.linalg.solve`` made a JAX-coded site "opaque"): the
  audit reads kernels by the facade's one definition, in the jaxpr and in
  the compiled program.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
import smartvjp
from smartvjp import _jaxprs
from smartvjp.audit import _count as C

CONFIGS = ("as_written", "smartvjp")


def _step(F, n=4):
  """A scan of ``n`` checkpointed layers, each calling ``F`` once."""
  def step(x, ws):
    def layer(c, w):
      return F(c * w), None
    loss = lambda x, ws: jnp.sum(
        jax.lax.scan(jax.checkpoint(layer), x, ws)[0] ** 2)
    return jax.grad(loss, argnums=(0, 1))(x, ws)
  return step, (jnp.ones((4, 8)), jnp.full((n, 4, 8), 0.5))


def executed(a, config, *args):
  K.reset()
  jax.block_until_ready(a._builds[config].compiled(*args))
  return {k: v for k, v in K.COUNTS.items() if v}


def counted(a, config, where="compiled"):
  (runs,) = a.runs(config, where).values()
  return {k: v for k, v in runs.items() if v}


def _bwd(x, g):
  return K.kernel("bwd", lambda x, g: (np.cos(x) * g,), [g], x, g)[0]


def test_a_kernel_in_a_while_loop_inside_fwd_is_counted_once_per_run():
  @jax.custom_vjp
  def F(x):
    return K.kernel("f", lambda x: (np.sin(x),), [x], x)[0]

  def fwd(x):
    def body(c):
      i, y = c
      return i + 1, K.kernel("fwd", lambda y: (np.sin(y),), [y], y)[0]
    return jax.lax.while_loop(lambda c: c[0] < 1, body, (0, x))[1], (x,)

  F.defvjp(fwd, lambda r, g: (_bwd(r[0], g),))
  step, args = _step(F)
  a = smartvjp.audit(step, *args, configs=CONFIGS)
  for config in CONFIGS:
    ran = executed(a, config, *args)
    assert counted(a, config) == ran, config
    assert counted(a, config, "jaxpr") == ran, config   # was fwd 5 for 4


def test_a_loop_invariant_piece_of_fwd_moved_out_of_the_scan_is_no_run():
  w = jnp.full((8, 8), 0.1)

  @jax.custom_vjp
  def F(x):
    return K.kernel("f", lambda x: (np.tanh(x),), [x], x @ jnp.exp(w))[0]

  def fwd(x):
    e = jnp.exp(w)            # loop-invariant: JAX's scan moves it out
    (y,) = K.kernel("fwd", lambda x: (np.tanh(x),), [x], x @ e)
    return y, (y, e)

  def bwd(r, g):
    y, e = r
    (d,) = K.kernel("bwd", lambda y, g: (g * (1 - y * y),), [g], y, g)
    return (d @ e.T,)

  F.defvjp(fwd, bwd)
  step, args = _step(F)
  a = smartvjp.audit(step, *args, configs=CONFIGS)
  closed = a._builds["as_written"].closed.jaxpr
  top = [e for e in closed.eqns if "svjpaudit_" in str(e.source_info.name_stack)
         and e.primitive.name == "exp"]
  assert top, "the case is gone: JAX no longer moves the piece out of the loop"
  for config in CONFIGS:
    ran = executed(a, config, *args)
    assert counted(a, config) == ran, config      # was fwd 9 for 8
    assert counted(a, config, "jaxpr") == ran, config


def test_a_rule_with_no_operations_says_no_work():
  @jax.custom_vjp
  def F(x):
    return x

  F.defvjp(lambda x: (x, None), lambda r, g: (K.kernel(
      "bwd", lambda g: (g * 0.5,), [g], g)[0],))
  step, args = _step(F)
  a = smartvjp.audit(step, *args, configs=CONFIGS)
  (s,) = a.sites
  assert s["no_work"] == ["f", "fwd"]
  for config in CONFIGS:
    assert counted(a, config) == executed(a, config, *args) == {"bwd": 4}
  assert "bwd 4; f, fwd no work" in a.table()
  assert "f 0" not in a.table() and "fwd 0" not in a.table()
  assert s["suggestion"].startswith("no action: f and fwd do no work")


def _lapack_site(counter):
  """A JAX-coded site whose rules call LAPACK (``eigh``, ``solve``: custom
  calls on the CPU), with a host counter in ``bwd`` that is no opaque
  kernel (``jax.debug.callback``)."""
  @jax.custom_vjp
  def F(x):
    return jnp.linalg.eigh(x @ x.T + jnp.eye(x.shape[0]))[0][:, None] * x

  def fwd(x):
    return F(x), x

  def bwd(x, g):
    jax.debug.callback(lambda: counter.update(["bwd"]))
    a = x @ x.T + jnp.eye(x.shape[0])
    w, v = jnp.linalg.eigh(a)
    return (jnp.linalg.solve(a, g) + (v * w) @ v.T @ g,)
  F.defvjp(fwd, bwd)
  return F


def test_lapack_in_a_rule_is_not_a_kernel():
  counter = K.COUNTS
  step, args = _step(_lapack_site(counter))
  a = smartvjp.audit(step, *args, configs=CONFIGS)
  (s,) = a.sites
  hlo = a._builds["as_written"].hlo
  assert "lapack_" in hlo, "no LAPACK custom call: the case is gone"
  # the facade's one definition, in the jaxpr and in the compiled program
  assert not any(_jaxprs.is_opaque_kernel(e) for e in _jaxprs.equations(
      a._builds["as_written"].closed.jaxpr) for e in [e[0]])
  assert not s["opaque"] and s["runs"]["as_written"]["kernel_launches"] == 0
  comps, _ = C.parse_hlo(hlo)
  lapack = [i for c in comps.values() for i in c
            if i.opcode == "custom-call" and "lapack" in (i.target or "")]
  assert lapack and not any(C.is_kernel(i) for i in lapack)
  for config in CONFIGS:
    ran = executed(a, config, *args)
    # was bwd 12 for 4 (each LAPACK call one "run")
    assert counted(a, config)["bwd"] == ran["bwd"] == 4, config
  assert "opaque" not in s["suggestion"] and "kernel launches" not in \
      s["suggestion"]


@pytest.mark.parametrize("name,kernel", [
    ("pure_callback", True), ("ffi_call", True), ("pallas_call", True),
    ("lu", False), ("eigh", False), ("debug_callback", False), ("", True)])
def test_a_compiled_custom_call_is_a_kernel_by_the_facades_definition(
    name, kernel):
  ins = C.Instr("custom-call", f"jit(step)/jvp()/svjpaudit_0_0_fwd/{name}"
                if name else "", "some_target", {}, [], None)
  assert C.is_kernel(ins) == kernel
  assert _jaxprs.is_opaque_kernel_name(name) == (kernel and bool(name))
