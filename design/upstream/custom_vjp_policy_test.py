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

"""Tests of ``optimize_remat=True`` following the checkpoint policy (remat3).

The rules of the custom_vjp function under test are opaque kernels, of two
kinds: a host callback, which dead-code elimination removes when its outputs
are unused (as it removes a ``pallas_call``), and a primitive that nothing
removes (lowered to a callback with side effects). Each kernel runs under a
name scope naming its rule, so the compiled HLO says which rule each launch
belongs to; launch counts are read from the HLO compiled for the CPU, and are
static (a kernel inside a loop body counts once).
"""

import collections
from functools import partial
import re

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

import jax
from jax import lax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.ad_checkpoint import checkpoint_name_fwd
from jax.experimental import io_callback
from jax._src import config
from jax._src import core
from jax._src import dispatch
from jax._src import test_util as jtu
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.interpreters import remat

config.parse_flags_with_absl()

_launched = collections.Counter()  # host runs per rule, for the eager tests

_RULES = dict(
    f=lambda x: (np.sin(x),),
    fwd=lambda x: (np.sin(x), np.cos(x)),
    bwd=lambda cos_x, g: (cos_x * g,))


def _host(rule):
  def host(*xs):
    _launched[rule] += 1
    return tuple(np.asarray(o, xs[0].dtype) for o in _RULES[rule](*xs))
  return host


def _shapes(rule, x):
  return (jax.ShapeDtypeStruct(x.shape, x.dtype),) * (2 if rule == 'fwd' else 1)


# A kernel that nothing removes: its DCE rule keeps it, and it lowers to a
# callback with side effects.
_kept_p = core.Primitive('kept_kernel')
_kept_p.multiple_results = True
_kept_p.def_abstract_eval(
    lambda x, *_, rule: [core.ShapedArray(x.shape, x.dtype)] * len(_shapes(rule, x)))
_kept_p.def_impl(partial(dispatch.apply_primitive, _kept_p))
mlir.register_lowering(_kept_p, mlir.lower_fun(
    lambda *xs, rule: io_callback(_host(rule), _shapes(rule, xs[0]), *xs,
                                  ordered=False),
    multiple_results=True))
pe.dce_rules[_kept_p] = lambda *args: ([True] * len(args[-1].invars), args[-1])


def _kernel(rule, *args, kind='callback'):
  with jax.named_scope(f'kernel_{rule}'):
    if kind == 'kept':
      return tuple(_kept_p.bind(*args, rule=rule))
    return jax.pure_callback(_host(rule), _shapes(rule, args[0]), *args,
                             vmap_method='broadcast_all')


# What fwd does to x before its kernel: array constants of each kind, or a
# JAX dot, all of which leave x as it is.
_ONES = jnp.ones(8, np.float32)
_PRE = dict(
    none=lambda x: x,
    jnp_scalar=lambda x: x * jnp.float32(1.),
    closed_over=lambda x: x * _ONES,
    numpy_array=lambda x: x * np.ones(x.shape, x.dtype),
    mask=lambda x: x * (np.arange(x.shape[-1]) >= 0).astype(x.dtype),
    dot=lambda x: jnp.dot(x, jnp.eye(x.shape[-1], dtype=x.dtype),
                          precision=lax.Precision.HIGHEST))


def _sin(optimize_remat, nondiff=False, kind='callback', pre='none',
         unnamed=False):
  """``sin`` as a custom_vjp whose f, fwd and bwd are one kernel each; fwd
  names its residual ``'cos'``. With ``nondiff``, a first argument is static;
  with ``unnamed``, fwd also returns ``2 * x``, not named, which bwd reads."""
  def f(*args):
    return _kernel('f', args[-1], kind=kind)[0]
  def f_fwd(*args):
    y, cos_x = _kernel('fwd', _PRE[pre](args[-1]), kind=kind)
    cos_x = checkpoint_name(cos_x, 'cos')
    return y, ((cos_x, 2. * args[-1]) if unnamed else cos_x)
  def f_bwd(*args):
    res, g = args[-2:]
    if unnamed:
      cos_x, twice_x = res
      return (_kernel('bwd', cos_x, g, kind=kind)[0] + 0. * twice_x,)
    return _kernel('bwd', res, g, kind=kind)
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
    other_names=jax.checkpoint_policies.save_only_these_names('other'),
    names_but_other=jax.checkpoint_policies.save_any_names_but_these('other'),
    names_but_cos=jax.checkpoint_policies.save_any_names_but_these('cos'),
    offload=jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=['cos'],
        offload_src='device', offload_dst='pinned_host'))


def _step(program, sin, policy):
  """value_and_grad of a loss that applies ``sin`` under jax.checkpoint."""
  ckpt = lambda g: jax.checkpoint(g, policy=_POLICIES[policy])
  if program == 'scan':
    def loss(x):
      return lax.scan(lambda c, _: (ckpt(sin)(c), None), x, None,
                      length=4)[0].sum()
    return jax.value_and_grad(loss)
  if program == 'uses_output':  # the backward pass needs sin's output
    return jax.value_and_grad(ckpt(lambda x: (sin(x) * jnp.cos(x)).sum()))
  step = jax.value_and_grad(ckpt(lambda x: sin(x).sum()))
  return jax.vmap(step) if program == 'vmap' else step


def _expected(program, x):
  if program == 'scan':
    return jax.value_and_grad(
        lambda x: lax.fori_loop(0, 4, lambda _, c: jnp.sin(c), x).sum())(x)
  if program == 'uses_output':
    return jax.value_and_grad(lambda x: (jnp.sin(x) * jnp.cos(x)).sum())(x)
  if program == 'vmap':
    return jnp.sin(x).sum(1), jnp.cos(x)
  return jnp.sin(x).sum(), jnp.cos(x)


def _input(program):
  x = jnp.linspace(0.1, 0.9, 8, dtype=np.float32)
  return x.reshape(2, 4) if program == 'vmap' else x


_NOT_SAVED = dict(f=1, fwd=1, bwd=1)  # f forward; fwd, bwd backward
_SAVED = dict(f=0, fwd=1, bwd=1)      # fwd forward; bwd on the saved residual


def _case(name, program, policy, expected, kind='callback', pre='none'):
  return dict(testcase_name=name, program=program, policy=policy,
              expected=expected, kind=kind, pre=pre)


@jtu.with_config(jax_remat3=True, jax_custom_vjp3=True)
class RematKeptOutputsTest(jtu.JaxTestCase):
  """remat_transform's report of which outputs the policy keeps."""

  @parameterized.parameters(None, 'names', 'offload')
  def test_kept_outs(self, policy):
    def fun(x):
      saved = checkpoint_name(jnp.cos(x), 'cos')
      return x, jnp.sin(x), saved
    kept = []
    x = _input('plain')
    def probe(x):
      remat.remat_transform(_POLICIES.get(policy), fun, x,
                            custom_vjp_rules=False, kept_outs=kept)
    jax.jit(probe).trace(x)
    self.assertEqual(kept[0], ('input', 0))
    self.assertIsNone(kept[1])
    if policy is None:
      self.assertIsNone(kept[2])
    else:
      self.assertEqual(kept[2][:2], ('res', 0))
      self.assertEqual(kept[2][2] is None, policy == 'names')

  def test_without_kept_outs(self):
    # The report is optional; without it remat_transform is as before.
    x = _input('plain')
    out, rem = remat.remat_transform(_POLICIES['names'], jnp.sin, x,
                                     custom_vjp_rules=False)
    self.assertAllClose(out, jnp.sin(x))
    self.assertAllClose(rem(x), jnp.sin(x))

  def test_offloaded_copy_second_order(self):
    # The rem side of checkpoint_name_fwd reads the offloaded copy, so a
    # second derivative sends a cotangent through the copy, which must go
    # back to the memory the value came from.
    @jax.custom_vjp
    def sin(x):
      return jnp.sin(x)
    def sin_fwd(x):
      return jnp.sin(x), checkpoint_name_fwd(jnp.cos(x), 'cos')
    sin.defvjp(sin_fwd, lambda cos_x, g: (cos_x * g,))
    g = jax.grad(jax.checkpoint(lambda x: sin(x).sum(),
                                policy=_POLICIES['offload']))
    x = _input('plain')
    self.assertAllClose(jax.jit(jax.grad(lambda x: g(x).sum()))(x),
                        -jnp.sin(x))
    self.assertAllClose(jax.grad(lambda x: g(x).sum())(x), -jnp.sin(x))


@jtu.with_config(jax_remat3=True, jax_custom_vjp3=True)
class CustomVJPOptimizeRematPolicyTest(jtu.JaxTestCase):
  """optimize_remat=True asks the policy: where it keeps every residual of
  fwd, fwd runs forward and the backward pass reads them (fwd is not run
  again, even where nothing would remove it); otherwise f runs forward and fwd
  then bwd backward."""

  @parameterized.named_parameters(
      # The policy keeps no residual of fwd's.
      _case('no_policy', 'plain', 'nothing', _NOT_SAVED),
      _case('dots_saveable', 'plain', 'dots', _NOT_SAVED),
      _case('other_name_saved', 'plain', 'other_names', _NOT_SAVED),
      _case('residual_name_excluded', 'plain', 'names_but_cos', _NOT_SAVED),
      _case('nondiff_arg', 'nondiff', 'nothing', _NOT_SAVED),
      _case('vmap', 'vmap', 'nothing', _NOT_SAVED),
      _case('scan', 'scan', 'nothing', _NOT_SAVED),
      _case('output_used', 'uses_output', 'dots', _NOT_SAVED),
      _case('kept_kernel', 'plain', 'dots', _NOT_SAVED, kind='kept'),
      # Array constants in fwd are not values the policy keeps.
      _case('jnp_scalar_in_fwd', 'plain', 'dots', _NOT_SAVED, pre='jnp_scalar'),
      _case('closed_over_array_in_fwd', 'plain', 'dots', _NOT_SAVED,
            pre='closed_over'),
      _case('numpy_array_in_fwd', 'plain', 'dots', _NOT_SAVED,
            pre='numpy_array'),
      _case('mask_in_fwd', 'plain', 'dots', _NOT_SAVED, pre='mask'),
      # dots_saveable saves the dot before the kernel, not the residual.
      _case('dot_then_kernel', 'plain', 'dots', _NOT_SAVED, pre='dot'),
      _case('dot_then_kernel_kept', 'plain', 'dots', _NOT_SAVED, kind='kept',
            pre='dot'),
      # The policy saves or offloads fwd's residual: fwd forward, and bwd on
      # the kept value. (Were the decision lost, say with
      # CustomVJPTraced.remat gone, these would run f as well.)
      _case('everything_saveable', 'plain', 'everything', _SAVED),
      _case('residual_name_saved', 'plain', 'names', _SAVED),
      _case('residual_saved_any_name_but_other', 'plain', 'names_but_other',
            _SAVED),
      _case('residual_offloaded', 'plain', 'offload', _SAVED),
      _case('residual_offloaded_kept_kernel', 'plain', 'offload', _SAVED,
            kind='kept'),
      _case('scan_residual_saved', 'scan', 'names', _SAVED),
      _case('residual_saved_jnp_scalar_in_fwd', 'plain', 'names', _SAVED,
            pre='jnp_scalar'),
      _case('residual_saved_mask_in_fwd', 'plain', 'names', _SAVED,
            pre='mask'),
      _case('kept_kernel_residual_saved', 'plain', 'names', _SAVED,
            kind='kept'),
      _case('kept_kernel_scan', 'scan', 'names', _SAVED, kind='kept'),
      _case('kept_kernel_numpy_array_in_fwd', 'plain', 'names', _SAVED,
            kind='kept', pre='numpy_array'),
      _case('vmap_residual_saved', 'vmap', 'names', _SAVED),
      # f recomputes the output the backward pass needs; fwd is not replayed.
      _case('output_used_residual_saved', 'uses_output', 'names', _NOT_SAVED),
      _case('output_used_kept_kernel', 'uses_output', 'names', _NOT_SAVED,
            kind='kept'),
  )
  @jtu.run_on_devices('cpu')
  def test_launches(self, program, policy, expected, kind, pre):
    sin = _sin(True, nondiff=program == 'nondiff', kind=kind, pre=pre)
    step = _step(program, sin, policy)
    x = _input(program)
    self.assertEqual(_launches(step, x), expected)
    self.assertAllClose(jax.jit(step)(x), _expected(program, x))

  @parameterized.named_parameters(
      ('no_policy', 'plain', 'nothing', 'callback', _NOT_SAVED),
      ('no_policy_kept_kernel', 'plain', 'nothing', 'kept', _NOT_SAVED),
      ('residual_name_saved', 'plain', 'names', 'callback', _SAVED),
      ('residual_offloaded', 'plain', 'offload', 'callback', _SAVED),
      ('residual_offloaded_kept_kernel', 'plain', 'offload', 'kept', _SAVED),
      ('everything_saveable', 'plain', 'everything', 'callback', _SAVED),
      ('nondiff_arg', 'nondiff', 'names', 'callback', _SAVED),
      ('vmap', 'vmap', 'names', 'callback', _SAVED),
  )
  def test_eager_launches(self, program, policy, kind, expected):
    step = _step(program, _sin(True, nondiff=program == 'nondiff', kind=kind),
                 policy)
    x = _input(program)
    _launched.clear()
    out = jax.block_until_ready(step(x))
    self.assertEqual(dict(_launched), {k: v for k, v in expected.items() if v})
    self.assertAllClose(out, _expected(program, x))

  @parameterized.named_parameters(('names', 'names'), ('offload', 'offload'))
  @jtu.run_on_devices('cpu')
  def test_launches_unnamed_residual(self, policy):
    # fwd also returns a residual the policy does not keep (2 * x, not
    # named), so True keeps f forward. False replays fwd for that residual;
    # the replayed kernel's outputs are not read (the named one is kept), so
    # DCE removes it: here True runs one launch more than False.
    x = _input('plain')
    for optimize_remat, expected in ((True, _NOT_SAVED),
                                     (False, dict(f=0, fwd=1, bwd=1))):
      step = _step('plain', _sin(optimize_remat, unnamed=True), policy)
      self.assertEqual(_launches(step, x), expected)
      self.assertAllClose(jax.jit(step)(x), _expected('plain', x))

  @parameterized.parameters('nothing', 'names', 'offload')
  def test_effect_in_fwd_runs_once(self, policy):
    # An effect in fwd runs once per step, whichever side of the checkpoint
    # fwd runs on: backward where the policy keeps nothing, forward (and not
    # again) where it keeps the residual.
    runs = collections.Counter()
    @jax.custom_vjp
    def sin(x):
      return jnp.sin(x)
    def sin_fwd(x):
      jax.debug.callback(lambda: runs.update(['fwd']))
      return jnp.sin(x), checkpoint_name(jnp.cos(x), 'cos')
    sin.defvjp(sin_fwd, lambda cos_x, g: (cos_x * g,), optimize_remat=True)
    step = jax.grad(jax.checkpoint(lambda x: sin(x).sum(),
                                   policy=_POLICIES[policy]))
    x = _input('plain')
    for run in (step, jax.jit(step)):
      jax.block_until_ready(run(x))  # compiled under jit
      jax.effects_barrier()
      runs.clear()
      g = jax.block_until_ready(run(x))
      jax.effects_barrier()
      self.assertEqual(dict(runs), {'fwd': 1})
      self.assertAllClose(g, jnp.cos(x))

  @parameterized.parameters('nothing', 'names', 'offload')
  def test_second_order(self, policy):
    # Rules written in JAX, so that they can be differentiated again. With
    # the residual offloaded, bwd reads its copy brought back from host
    # memory, and the second derivative's cotangent goes back through it.
    @jax.custom_vjp
    def sin(x):
      return jnp.sin(x)
    def sin_fwd(x):
      return jnp.sin(x), checkpoint_name(jnp.cos(x), 'cos')
    sin.defvjp(sin_fwd, lambda cos_x, g: (cos_x * g,), optimize_remat=True)
    g = jax.grad(jax.checkpoint(lambda x: sin(x).sum(),
                                policy=_POLICIES[policy]))
    x = _input('plain')
    self.assertAllClose(jax.jit(jax.grad(lambda x: g(x).sum()))(x),
                        -jnp.sin(x))
    self.assertAllClose(jax.grad(lambda x: g(x).sum())(x), -jnp.sin(x))

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
    sin.defvjp(sin_fwd, sin_bwd, optimize_remat=True)
    step = jax.value_and_grad(jax.checkpoint(lambda x: sin(x).sum(),
                                             policy=_POLICIES['names']))
    x = _input('plain')
    self.assertAllClose(step(x), _expected('plain', x))
    self.assertAllClose(jax.jit(step)(x), _expected('plain', x))

  @parameterized.parameters('nothing', 'dots', 'names')
  def test_custom_jvp_in_fwd(self, policy):
    # remat_transform cannot trace a custom_jvp call in fwd yet (JAX's
    # default rule raises there): the decision keeps f forward.
    @jax.custom_vjp
    def relu(x):
      return jax.nn.relu(x)
    def relu_fwd(x):
      return jax.nn.relu(x), checkpoint_name(x, 'cos')
    relu.defvjp(relu_fwd, lambda x, g: (jnp.where(x > 0, g, 0.),),
                optimize_remat=True)
    step = jax.grad(jax.checkpoint(lambda x: relu(x).sum(),
                                   policy=_POLICIES[policy]))
    x = jnp.array([-1., 2.], np.float32)
    self.assertAllClose(step(x), jnp.array([0., 1.], np.float32))
    self.assertAllClose(jax.jit(step)(x), jnp.array([0., 1.], np.float32))

  @parameterized.parameters((False, False), (True, False), (False, True))
  @jtu.run_on_devices('cpu')
  def test_unchanged_without_both_flags(self, remat3, custom_vjp3):
    # Without both flags the policy is not asked: f forward, fwd and bwd
    # backward, whatever it saves.
    x = _input('plain')
    with config.remat3(remat3), config.custom_vjp3(custom_vjp3):
      for policy in ('nothing', 'names'):
        step = _step('plain', _sin(True), policy)
        self.assertEqual(_launches(step, x), _NOT_SAVED)
        self.assertAllClose(jax.jit(step)(x), _expected('plain', x))


if __name__ == '__main__':
  absltest.main(testLoader=jtu.JaxTestLoader())
