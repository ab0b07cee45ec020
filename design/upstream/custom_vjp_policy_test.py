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

"""Tests of ``custom_vjp.defvjp(..., optimize_remat='policy')`` (PR 1).

The rules of the custom_vjp function under test are opaque kernels: host
callbacks, which dead-code elimination removes when their outputs are unused,
as it removes a ``pallas_call``. Each runs under a name scope naming its rule,
so the compiled HLO says which rule each launch belongs to. Counts are static
(a kernel inside a loop body counts once).
"""

import collections
import re

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

import jax
from jax import lax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax._src import config
from jax._src import test_util as jtu

config.parse_flags_with_absl()

_launched = collections.Counter()  # host runs per rule, for the eager test

_RULES = dict(
    f=lambda x: (np.sin(x),),
    fwd=lambda x: (np.sin(x), np.cos(x)),
    bwd=lambda cos_x, g: (cos_x * g,))


def _kernel(rule, *args):
  def host(*xs):
    _launched[rule] += 1
    return tuple(np.asarray(o, xs[0].dtype) for o in _RULES[rule](*xs))
  out = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)
  n_out = 2 if rule == 'fwd' else 1
  with jax.named_scope(f'kernel_{rule}'):
    return jax.pure_callback(host, (out,) * n_out, *args,
                             vmap_method='broadcast_all')


def _sin(optimize_remat, nondiff=False):
  """``sin`` as a custom_vjp whose f, fwd and bwd are one kernel each; fwd
  names its residual ``'cos'``. With ``nondiff``, a first argument is static."""
  def f(*args):
    return _kernel('f', args[-1])[0]
  def f_fwd(*args):
    y, cos_x = _kernel('fwd', args[-1])
    return y, checkpoint_name(cos_x, 'cos')
  def f_bwd(*args):
    cos_x, g = args[-2:]
    return _kernel('bwd', cos_x, g)
  sin = jax.custom_vjp(f, nondiff_argnums=(0,) if nondiff else ())
  sin.defvjp(f_fwd, f_bwd, optimize_remat=optimize_remat)
  return (lambda x: sin('static', x)) if nondiff else sin


def _launches(fun, *args):
  hlo = jax.jit(fun).lower(*args).compile().as_text()
  return {rule: len(re.findall(rf'custom-call\(.*kernel_{rule}\b', hlo))
          for rule in _RULES}


_POLICIES = dict(
    nothing=None,
    dots=jax.checkpoint_policies.dots_saveable,
    everything=jax.checkpoint_policies.everything_saveable,
    names=jax.checkpoint_policies.save_only_these_names('cos'),
    other_names=jax.checkpoint_policies.save_only_these_names('other'))


def _step(program, sin, policy):
  """value_and_grad of a loss that applies ``sin`` under jax.checkpoint."""
  ckpt = lambda g: jax.checkpoint(g, policy=_POLICIES[policy])
  if program == 'scan':
    def loss(x):
      return lax.scan(lambda c, _: (ckpt(sin)(c), None), x, None,
                      length=4)[0].sum()
    return jax.value_and_grad(loss)
  step = jax.value_and_grad(ckpt(lambda x: sin(x).sum()))
  return jax.vmap(step) if program == 'vmap' else step


def _expected(program, x):
  if program == 'scan':
    return jax.value_and_grad(
        lambda x: lax.fori_loop(0, 4, lambda _, c: jnp.sin(c), x).sum())(x)
  if program == 'vmap':
    return jnp.sin(x).sum(1), jnp.cos(x)
  return jnp.sin(x).sum(), jnp.cos(x)


@jtu.with_config(jax_remat3=True, jax_custom_vjp3=True)
class CustomVJPOptimizeRematPolicyTest(jtu.JaxTestCase):

  @parameterized.named_parameters(
      # The policy saves nothing that fwd computes: the forward pass runs f,
      # the backward pass fwd then bwd.
      ('no_policy', 'plain', 'nothing', dict(f=1, fwd=1, bwd=1)),
      ('dots_saveable', 'plain', 'dots', dict(f=1, fwd=1, bwd=1)),
      ('other_name_saved', 'plain', 'other_names', dict(f=1, fwd=1, bwd=1)),
      ('nondiff_arg', 'nondiff', 'nothing', dict(f=1, fwd=1, bwd=1)),
      ('vmap', 'vmap', 'nothing', dict(f=1, fwd=1, bwd=1)),
      ('scan', 'scan', 'nothing', dict(f=1, fwd=1, bwd=1)),
      # The policy saves fwd's residual: the forward pass runs fwd, and the
      # backward pass bwd on the saved value. (Were the decision lost, say
      # with CustomVJPTraced.remat gone, these would run f as well.)
      ('everything_saveable', 'plain', 'everything', dict(f=0, fwd=1, bwd=1)),
      ('residual_name_saved', 'plain', 'names', dict(f=0, fwd=1, bwd=1)),
      ('scan_residual_saved', 'scan', 'names', dict(f=0, fwd=1, bwd=1)),
  )
  def test_launches(self, program, policy, expected):
    sin = _sin('policy', nondiff=program == 'nondiff')
    step = _step(program, sin, policy)
    x = jnp.linspace(0.1, 0.9, 8, dtype=np.float32)
    if program == 'vmap':
      x = x.reshape(2, 4)
    self.assertEqual(_launches(step, x), expected)
    self.assertAllClose(jax.jit(step)(x), _expected(program, x))

  def test_eager_launches(self):
    sin = _sin('policy')
    step = _step('plain', sin, 'nothing')
    x = jnp.linspace(0.1, 0.9, 8, dtype=np.float32)
    _launched.clear()
    out = jax.block_until_ready(step(x))
    self.assertEqual(dict(_launched), dict(f=1, fwd=1, bwd=1))
    self.assertAllClose(out, _expected('plain', x))

  @parameterized.parameters('nothing', 'names')
  def test_second_order(self, policy):
    # Rules written in JAX, so that they can be differentiated again.
    @jax.custom_vjp
    def sin(x):
      return jnp.sin(x)
    def sin_fwd(x):
      return jnp.sin(x), checkpoint_name(jnp.cos(x), 'cos')
    sin.defvjp(sin_fwd, lambda cos_x, g: (cos_x * g,), optimize_remat='policy')
    g = jax.grad(jax.checkpoint(lambda x: sin(x).sum(),
                                policy=_POLICIES[policy]))
    x = jnp.linspace(0.1, 0.9, 8, dtype=np.float32)
    self.assertAllClose(jax.jit(jax.grad(lambda x: g(x).sum()))(x),
                        -jnp.sin(x))
    self.assertAllClose(jax.grad(lambda x: g(x).sum())(x), -jnp.sin(x))

  @parameterized.parameters((False, False), (True, False), (False, True))
  def test_acts_as_false_without_both_flags(self, remat3, custom_vjp3):
    x = jnp.linspace(0.1, 0.9, 8, dtype=np.float32)
    with config.remat3(remat3), config.custom_vjp3(custom_vjp3):
      for policy in ('nothing', 'names'):
        steps = [_step('plain', _sin(opt), policy) for opt in (False, 'policy')]
        self.assertEqual(*(_launches(step, x) for step in steps))
        self.assertAllClose(jax.jit(steps[1])(x), _expected('plain', x))

  @parameterized.parameters(True, False)
  def test_symbolic_zeros_refused(self, custom_vjp3):
    with config.custom_vjp3(custom_vjp3):
      f = jax.custom_vjp(jnp.sin)
      with self.assertRaisesRegex(NotImplementedError, 'symbolic zeros'):
        f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g,),
                 symbolic_zeros=True, optimize_remat='policy')

  @parameterized.parameters(True, False)
  def test_unknown_string_refused(self, custom_vjp3):
    with config.custom_vjp3(custom_vjp3):
      f = jax.custom_vjp(jnp.sin)
      with self.assertRaisesRegex(ValueError, "'policy'"):
        f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g,),
                 optimize_remat='always')


if __name__ == '__main__':
  absltest.main(testLoader=jtu.JaxTestLoader())
