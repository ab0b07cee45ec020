"""Property test: random small compositions (remat or not, scan or not, vmap
or not, a standard policy, named residual or not, fused rule or not, direct
linearize on or off) give jax.custom_vjp's gradients and the contract's counts.

Count oracle, per call site: residuals saved by the policy -> fwd + bwd;
rematerialized -> f (its primal is needed by the loss) + fwd + bwd, or
f + fwd_bwd when the fused rule is given; no remat -> fwd + bwd."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st
from jax.ad_checkpoint import checkpoint_name

import kernels as K
from smartvjp import smart_custom_vjp

POLICIES = {
    "none": None,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "save_res_name": jax.checkpoint_policies.save_only_these_names("res"),
}


def build(named, fused):
  f, fwd, bwd, fb = K.sin_rules()
  if named:
    plain_fwd = fwd

    def fwd(x):
      y, (c,) = plain_fwd(x)
      return y, (checkpoint_name(c, "res"),)
  s = smart_custom_vjp(f)
  s.defvjp(fwd, bwd, fwd_bwd=fb if fused else None)
  r = jax.custom_vjp(f)
  r.defvjp(fwd, bwd)
  return s, r


def oracle(remat, policy, named, fused, sites):
  if not remat:
    per = {"fwd": 1, "bwd": 1}
  elif policy == "everything_saveable" or (policy == "save_res_name" and named):
    per = {"fwd": 1, "bwd": 1}
  elif fused:
    per = {"f": 1, "fwd_bwd": 1}
  else:
    per = {"f": 1, "fwd": 1, "bwd": 1}
  return {k: v * sites for k, v in per.items()}


@settings(max_examples=40, deadline=None)
@given(remat=st.booleans(), scan=st.sampled_from([0, 2, 3]),
       batch=st.sampled_from([0, 2]), policy=st.sampled_from(sorted(POLICIES)),
       named=st.booleans(), fused=st.booleans(), direct=st.booleans())
def test_random_compositions(remat, scan, batch, policy, named, fused, direct):
  s, r = build(named, fused)

  def program(F):
    layer = jax.checkpoint(F, policy=POLICIES[policy]) if remat else F
    if scan:
      body = lambda c, _: (layer(c), None)
      net = lambda x: jax.lax.scan(body, x, None, length=scan)[0]
    else:
      net = layer
    loss = lambda x: jnp.sum(net(x) ** 2)
    g = jax.grad(loss)
    return jax.jit(jax.vmap(g) if batch else g)

  x = jnp.linspace(-1.0, 1.5, 3, dtype=jnp.float32)
  if batch:
    x = jnp.stack([x, x * 0.5])
  with K.config(jax_use_direct_linearize=direct):
    K.reset()
    got = jax.block_until_ready(program(s)(x))
    counts = dict(K.COUNTS)
    want = jax.block_until_ready(program(r)(x))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  sites = max(scan, 1) * max(batch, 1)
  assert counts == oracle(remat, policy, named, fused, sites)
