"""The equinox model example: counts per step, same gradients as equinox's
filter_custom_vjp, and the loss falls."""

import os
import sys

import equinox as eqx
import jax
import numpy as np

EX = os.path.join(os.path.dirname(__file__), os.pardir, "examples")
sys.path.insert(0, EX)
import equinox_mlp as EM  # noqa: E402

import smartvjp  # noqa: E402


def test_counts_per_step():
  assert EM.count_one_step(eqx.filter_custom_vjp) == {"fwd": 8, "bwd": 8}
  assert EM.count_one_step(smartvjp.filter_custom_vjp) == {"f": 4, "fwd": 4,
                                                          "bwd": 8}
  assert EM.count_one_step(smartvjp.filter_custom_vjp, fused=True) == {
      "f": 4, "fwd_bwd": 12}


def test_same_gradients_as_equinox():
  x, y = EM.data(jax.random.key(1))
  grads = []
  for deco in (eqx.filter_custom_vjp, smartvjp.filter_custom_vjp):
    model = EM.init(jax.random.key(0), EM.make_layer_op(deco))
    grads.append(eqx.filter_jit(eqx.filter_grad(EM.loss_fn))(model, x, y))
  for a, b in zip(jax.tree_util.tree_leaves(eqx.filter(grads[0], eqx.is_array)),
                  jax.tree_util.tree_leaves(eqx.filter(grads[1], eqx.is_array))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_loss_falls():
  losses = EM.train(smartvjp.filter_custom_vjp, fused=True, steps=60,
                    log_every=0)
  assert losses[-1] < 0.05 * losses[0]
