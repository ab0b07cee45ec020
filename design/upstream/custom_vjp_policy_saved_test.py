# Copyright 2026 The JAX Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Tests of follow-up 1: with ``optimize_remat='policy'``, a backward pass
that reads the residuals the policy saved instead of replaying ``fwd``.

It uses the kernels and programs of ``custom_vjp_policy_test.py`` (PR 1),
beside which it goes. Eager, nothing is removed, as for a kernel with side
effects under ``jit``: without this change the named case runs fwd twice.
"""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax._src import config
from jax._src import test_util as jtu

from custom_vjp_policy_test import (
    _expected, _launched, _launches, _POLICIES, _sin, _step)

config.parse_flags_with_absl()


@jtu.with_config(jax_remat3=True, jax_custom_vjp3=True)
class CustomVJPPolicySavedResidualsTest(jtu.JaxTestCase):

  @parameterized.named_parameters(
      ('residual_name_saved', 'plain', 'names'),
      ('everything_saveable', 'plain', 'everything'),
      ('nondiff_arg', 'nondiff', 'names'),
      ('vmap', 'vmap', 'names'),
  )
  def test_eager_launches(self, program, policy):
    step = _step(program, _sin('policy', nondiff=program == 'nondiff'), policy)
    x = jnp.linspace(0.1, 0.9, 8, dtype=np.float32)
    if program == 'vmap':
      x = x.reshape(2, 4)
    _launched.clear()
    out = jax.block_until_ready(step(x))
    self.assertEqual(dict(_launched), dict(fwd=1, bwd=1))
    self.assertAllClose(out, _expected(program, x))

  def test_output_used_in_backward_pass(self):
    # The region uses sin's output: f recomputes it, fwd is not replayed.
    sin = _sin('policy')
    step = jax.value_and_grad(jax.checkpoint(
        lambda x: (sin(x) * jnp.cos(x)).sum(), policy=_POLICIES['names']))
    x = jnp.linspace(0.1, 0.9, 8, dtype=np.float32)
    self.assertEqual(_launches(step, x), dict(f=1, fwd=1, bwd=1))
    expected = jax.value_and_grad(lambda x: (jnp.sin(x) * jnp.cos(x)).sum())(x)
    self.assertAllClose(jax.jit(step)(x), expected)

  def test_vmap_launches(self):
    step = _step('vmap', _sin('policy'), 'names')
    x = jnp.linspace(0.1, 0.9, 8, dtype=np.float32).reshape(2, 4)
    self.assertEqual(_launches(step, x), dict(f=0, fwd=1, bwd=1))
    self.assertAllClose(jax.jit(step)(x), _expected('vmap', x))

  def test_input_as_residual(self):
    # fwd returns an input as a residual beside the saved one; it is read
    # from the backward pass's arguments, not saved.
    @jax.custom_vjp
    def sin(x):
      return jnp.sin(x)
    def sin_fwd(x):
      return jnp.sin(x), (x, checkpoint_name(jnp.cos(x), 'cos'))
    def sin_bwd(res, g):
      x, cos_x = res
      return (cos_x * g + 0. * x,)
    sin.defvjp(sin_fwd, sin_bwd, optimize_remat='policy')
    step = jax.value_and_grad(jax.checkpoint(lambda x: sin(x).sum(),
                                             policy=_POLICIES['names']))
    x = jnp.linspace(0.1, 0.9, 8, dtype=np.float32)
    self.assertAllClose(step(x), _expected('plain', x))
    self.assertAllClose(jax.jit(step)(x), _expected('plain', x))

  def test_second_order(self):
    @jax.custom_vjp
    def sin(x):
      return jnp.sin(x)
    def sin_fwd(x):
      return jnp.sin(x), checkpoint_name(jnp.cos(x), 'cos')
    sin.defvjp(sin_fwd, lambda cos_x, g: (cos_x * g,), optimize_remat='policy')
    g = jax.grad(jax.checkpoint(lambda x: sin(x).sum(),
                                policy=_POLICIES['names']))
    x = jnp.linspace(0.1, 0.9, 8, dtype=np.float32)
    # Through the saved residual, bwd's output depends on x via jnp.cos.
    self.assertAllClose(jax.grad(lambda x: g(x).sum())(x), -jnp.sin(x))
    self.assertAllClose(jax.jit(jax.grad(lambda x: g(x).sum()))(x),
                        -jnp.sin(x))


if __name__ == '__main__':
  absltest.main(testLoader=jtu.JaxTestLoader())
