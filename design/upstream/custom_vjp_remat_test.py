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

"""Launch counts of custom_vjp rules under jax.checkpoint with jax_remat3.

Tests of ``defvjp(..., optimize_remat='policy')`` and of the fused rule
``defvjp(..., fwd_bwd=...)``, and tests pinning what ``optimize_remat=False``
and ``optimize_remat=True`` do, under the ``jax_remat3`` and
``jax_custom_vjp3`` implementations. Every rule is an opaque kernel that
counts its runs, of one of two kinds:

* ``callback``: a ``pure_callback``, which dead-code elimination removes when
  its outputs are unused, as it removes a ``pallas_call``;
* ``never_dce``: a test primitive whose DCE rule keeps it and which lowers to a
  side-effecting host callback, so that nothing removes it: a schedule that
  relies on a dead launch being removed shows in its counts.

Every test compares values and gradients with ``jnp.sin``'s.

``MEASURED_COUNTS_FILE``, when set in the environment, names a JSON file to
which the count tests append what they measured (for a table of launches).
"""

import collections
import functools
import json
import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

import jax
from jax import lax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import io_callback
from jax._src import config
from jax._src import core
from jax._src import dispatch
from jax._src import test_util as jtu
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe

config.parse_flags_with_absl()

# jax 0.12 differentiates a checkpoint under everything_saveable without
# rematerializing anything (ad_checkpoint.RematTraced.vjp_fwd); under 0.11's
# remat3 no rule saves an opaque kernel's outputs, whatever the policy.
EVERYTHING_BYPASSES_REMAT = jax.__version_info__ >= (0, 12)

COUNTS: collections.Counter = collections.Counter()
RULES = ('f', 'fwd', 'bwd', 'fwd_bwd')


@functools.cache  # the same callable for the same kernel: compiled once
def _host(name, fn):
  def run(*args):
    COUNTS[name] += 1
    return tuple(np.asarray(o) for o in fn(*map(np.asarray, args)))
  return run


@functools.cache
def numpy_rule(rule, k=1):
  """The numpy body of a sin kernel (the same object per ``(rule, k)``)."""
  return dict(
      f=lambda x: (np.sin(k * x),),
      fwd=lambda x: (np.sin(k * x), k * np.cos(k * x)),
      bwd=lambda c, g: (c * g,),
      fwd_bwd=lambda x, g: (k * np.cos(k * x) * g,))[rule]


def callback_kernel(name, fn, out_like, *args):
  """``fn(*args)`` (numpy, elementwise) as a pure_callback counted as name."""
  shapes = tuple(jax.ShapeDtypeStruct(jnp.shape(o), jnp.result_type(o))
                 for o in out_like)
  return jax.pure_callback(_host(name, fn), shapes, *args,
                           vmap_method='broadcast_all')


kernel_p = core.Primitive('remat_test_kernel')
kernel_p.multiple_results = True
kernel_p.def_abstract_eval(lambda *_, name, fn, out_avals: list(out_avals))
kernel_p.def_impl(functools.partial(dispatch.apply_primitive, kernel_p))


def _kernel_lowering(*args, name, fn, out_avals):
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
  return io_callback(_host(name, fn), shapes, *args, ordered=False)


mlir.register_lowering(
    kernel_p, mlir.lower_fun(_kernel_lowering, multiple_results=True))
# The DCE rule's arguments differ between versions; the equation is last.
pe.dce_rules[kernel_p] = lambda *args: ([True] * len(args[-1].invars), args[-1])


def _kernel_batch(args, dims, *, name, fn, out_avals):
  size = next(x.shape[d] for x, d in zip(args, dims)
              if d is not None)
  args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)]
  out_avals = tuple(core.ShapedArray((size, *a.shape), a.dtype)
                    for a in out_avals)
  outs = kernel_p.bind(*args, name=name, fn=fn, out_avals=out_avals)
  return outs, [0] * len(outs)


batching.primitive_batchers[kernel_p] = _kernel_batch


def never_dce_kernel(name, fn, out_like, *args):
  """``fn(*args)`` (numpy, elementwise) as a kernel that nothing removes."""
  out_avals = tuple(core.ShapedArray(jnp.shape(o), jnp.result_type(o))
                    for o in out_like)
  return kernel_p.bind(*args, name=name, fn=fn, out_avals=out_avals)


KERNELS = dict(callback=callback_kernel, never_dce=never_dce_kernel)

POLICIES = dict(
    nothing=None,
    everything=jax.checkpoint_policies.everything_saveable,
    dots=jax.checkpoint_policies.dots_saveable,
    names=jax.checkpoint_policies.save_only_these_names('c'))

def sin_function(kernel, mode, *, named=False, static=False):
  """``F(x) = sin(x)``, with ``static`` ``F(x, k) = sin(k x)`` for a Python
  int ``k`` passed as a nondiff argument; every rule one kernel launch, fwd's
  residual named 'c' when ``named``. ``mode`` says how the rules are
  registered: 'default' (``optimize_remat=False``), 'true', 'policy',
  'policy_fused' and 'true_fused' (with ``fwd_bwd``), or 'defremat' (by hand:
  f forward, fwd and bwd backward; jax 0.12 only)."""
  def f_k(x, k):
    return kernel('f', numpy_rule('f', k), [x], x)[0]

  def fwd_k(x, k):
    y, c = kernel('fwd', numpy_rule('fwd', k), [x, x], x)
    return y, checkpoint_name(c, 'c') if named else c

  def bwd(*args):  # (c, g), or (k, c, g)
    c, g = args[-2:]
    return (kernel('bwd', numpy_rule('bwd'), [g], c, g)[0],)

  def fwd_bwd_k(x, k, g):
    return (kernel('fwd_bwd', numpy_rule('fwd_bwd', k), [g], x, g)[0],)

  if static:
    f, fwd, fwd_bwd = f_k, fwd_k, fwd_bwd_k
  else:
    f = lambda x: f_k(x, 1)
    fwd = lambda x: fwd_k(x, 1)
    fwd_bwd = lambda x, g: fwd_bwd_k(x, 1, g)
  F = jax.custom_vjp(f, nondiff_argnums=(1,) if static else ())
  if mode == 'default':
    F.defvjp(fwd, bwd)
  elif mode == 'true':
    F.defvjp(fwd, bwd, optimize_remat=True)
  elif mode == 'policy':
    F.defvjp(fwd, bwd, optimize_remat='policy')
  elif mode == 'policy_fused':
    F.defvjp(fwd, bwd, optimize_remat='policy', fwd_bwd=fwd_bwd)
  elif mode == 'true_fused':
    F.defvjp(fwd, bwd, optimize_remat=True, fwd_bwd=fwd_bwd)
  elif mode == 'defremat':
    F.defvjp(fwd, bwd)
    F.defremat(lambda *a: (F(*a), None), lambda _, *a: fwd(*a), bwd)
  else:
    raise ValueError(mode)
  return F


def program(name, F, policy):
  """``(fn, x, reference)``: ``fn(x)`` is ``value_and_grad`` of a loss that
  applies ``F`` under ``jax.checkpoint(policy=policy)`` (the primal output
  is used), and ``reference`` its value with ``jnp.sin`` for ``F``."""
  x = jnp.linspace(0.1, 0.9, 8, dtype=jnp.float32)
  ck = lambda F: jax.checkpoint(F, policy=policy)

  def build(F):
    if name in ('plain', 'static'):
      G = (lambda x: F(x, 2)) if name == 'static' else F
      return jax.value_and_grad(lambda x: ck(G)(x).sum())
    if name == 'scan':  # four checkpointed layers in a scan
      def loss(x):
        y, _ = lax.scan(lambda c, _: (ck(F)(c), None), x, None, length=4)
        return y.sum()
      return jax.value_and_grad(loss)
    if name == 'cond':  # the branch taken holds F, inside the checkpoint
      body = lambda x: lax.cond(x.sum() > -1.0, F, jnp.cos, x)
      return jax.value_and_grad(lambda x: ck(body)(x).sum())
    if name == 'vmap':  # a batch of 8: one launch per rule for the batch
      return jax.vmap(jax.value_and_grad(lambda x: ck(F)(x).sum()))
    if name == 'vmap_inside':  # F batched inside the checkpoint
      return jax.value_and_grad(lambda x: ck(jax.vmap(F))(x).sum())
    if name == 'primal_used':  # the region uses F's output again
      return jax.value_and_grad(lambda x: ck(lambda x: jnp.sin(F(x)))(x).sum())
    raise ValueError(name)

  sin = (lambda x, k: jnp.sin(k * x)) if name == 'static' else jnp.sin
  return build(F), (x.reshape(8, 1) if name.startswith('vmap') else x), build(sin)


# ``tap_p(x)`` is ``x``, counting a run; dead-code elimination removes it when
# unused, like a callback kernel; its tangent is ``x``'s, so rules that tap
# their outputs can be differentiated to any order.
tap_p = core.Primitive('remat_test_tap')
tap_p.def_abstract_eval(lambda x, *, name: x)
tap_p.def_impl(functools.partial(dispatch.apply_primitive, tap_p))
mlir.register_lowering(tap_p, mlir.lower_fun(
    lambda x, *, name: callback_kernel(name, lambda x: (x,), [x], x)[0],
    multiple_results=False))
ad.primitive_jvps[tap_p] = (
    lambda primals, tangents, *, name: (tap_p.bind(*primals, name=name),
                                        tangents[0]))
batching.primitive_batchers[tap_p] = (
    lambda args, dims, *, name: (tap_p.bind(*args, name=name), dims[0]))


def tap(name, x):
  return tap_p.bind(x, name=name)


def jax_sin_function(mode, *, named=False):
  """``F(x) = sin(x)`` with JAX-coded rules, each counted by a ``tap``, for
  derivatives of any order."""
  f = lambda x: tap('f', jnp.sin(x))
  def fwd(x):
    c = jnp.cos(x)
    return tap('fwd', jnp.sin(x)), checkpoint_name(c, 'c') if named else c
  bwd = lambda c, g: (tap('bwd', c * g),)
  fwd_bwd = lambda x, g: (tap('fwd_bwd', jnp.cos(x) * g),)
  F = jax.custom_vjp(f)
  kw = dict(default={}, true=dict(optimize_remat=True),
            policy=dict(optimize_remat='policy'),
            policy_fused=dict(optimize_remat='policy', fwd_bwd=fwd_bwd))[mode]
  F.defvjp(fwd, bwd, **kw)
  return F


def grad_of_grad(test, mode, policy, jit):
  """Launches of ``grad(grad(loss))`` with ``loss(x) = sum(F(x)**2)`` and F
  under ``jax.checkpoint(policy=policy)``."""
  ck = lambda F: jax.checkpoint(F, policy=POLICIES[policy])
  def build(F):
    inner = jax.grad(lambda x: (ck(F)(x) ** 2).sum())
    return jax.grad(lambda x: inner(x).sum())
  fn = build(jax_sin_function(mode, named=policy == 'names'))
  fn = jax.jit(fn) if jit else fn
  x = jnp.linspace(0.1, 0.9, 8, dtype=jnp.float32)
  COUNTS.clear()
  out = jax.block_until_ready(fn(x))
  counts = dict(COUNTS)
  test.assertAllClose(out, build(jnp.sin)(x), rtol=1e-5, atol=1e-6)
  return record('grad_of_grad', mode, policy, 'tap', jit, counts)


def record(prog, mode, policy, kernel, jit, counts):
  measured = format_counts(counts)
  if path := os.environ.get('MEASURED_COUNTS_FILE'):
    with open(path, 'a') as f:
      f.write(json.dumps(dict(jax=jax.__version__, program=prog, mode=mode,
                              policy=policy, kernel=kernel, jit=bool(jit),
                              remat3=bool(config.remat3.value),
                              custom_vjp3=bool(config.custom_vjp3.value),
                              counts=measured)) + '\n')
  return measured


def format_counts(counts):
  return ', '.join(f'{r} {counts[r]}' for r in RULES if counts.get(r))


def measure(test, prog, mode, policy, kernel, jit):
  """Runs the program; asserts its values; returns the launches as text."""
  F = sin_function(KERNELS[kernel], mode, named=policy == 'names',
                   static=prog == 'static')
  fn, x, reference = program(prog, F, POLICIES[policy])
  fn = jax.jit(fn) if jit else fn
  COUNTS.clear()
  out = jax.block_until_ready(fn(x))
  counts = dict(COUNTS)
  test.assertAllClose(out, reference(x), rtol=1e-5, atol=1e-6)
  return record(prog, mode, policy, kernel, jit, counts)


def expected(prog, mode, policy, kernel, jit):
  """What a program measures, from the schedule ``mode`` implies: launches
  as text, or the type name of a known JAX error that the rules under test do
  not cause."""
  v12 = EVERYTHING_BYPASSES_REMAT
  if not v12:
    if prog == 'cond' and policy == 'names' and mode != 'true':
      # The rem side's fwd closes over the saved residual, a tracer of the
      # branch's trace (fixed on the 0.12 line by PR #40178).
      return 'TypeError'
    if prog == 'vmap' and policy == 'names' and mode == 'default':
      return 'AssertionError'  # jax 0.11's default rule under vmap of grad
  n = 4 if prog == 'scan' else 1
  fused = mode in ('policy_fused', 'true_fused')
  if policy == 'everything' and v12:
    schedule = 'save'  # no remat at all: fwd forward, bwd backward
  elif not v12 and prog == 'vmap_inside':
    schedule = 'primal'  # 0.11 batches it as VmapOf, whose remat rule is full
    fused = False        # remat, with fwd and bwd differentiated in the region
  elif mode in ('true', 'true_fused', 'defremat'):
    schedule = 'primal'
  elif mode in ('policy', 'policy_fused'):
    schedule = 'save' if policy == 'names' else 'primal'
  else:
    schedule = 'replay'

  if schedule == 'primal':  # f forward; fwd and bwd, or fwd_bwd, backward
    if not fused:
      return f'f {n}, fwd {n}, bwd {n}'
    # the region recomputes F's output with f where it uses it
    return f'f {2 * n if prog == "primal_used" else n}, fwd_bwd {n}'
  if schedule == 'save':  # fwd forward, saving; bwd backward
    if prog == 'primal_used' and policy == 'names':
      return f'f {n}, fwd {n}, bwd {n}'  # f recomputes the unsaved output
    return f'fwd {n}, bwd {n}'
  # optimize_remat=False: fwd forward, and the rem side replays fwd; where the
  # policy saved fwd's residual, dead-code elimination removes the replay of
  # a callback kernel, if it sees it (jit, or a staged scan or cond), and the
  # region does not use F's output.
  dropped = (policy == 'names' and kernel == 'callback' and
             prog != 'primal_used' and (jit or prog in ('scan', 'cond')))
  return f'fwd {n if dropped else 2 * n}, bwd {n}'


PROGRAMS = ('scan', 'cond', 'vmap', 'vmap_inside', 'static', 'primal_used')


class _LaunchTestCase(jtu.JaxTestCase):

  def check(self, prog, mode, policy, kernel, jit):
    want = expected(prog, mode, policy, kernel, jit)
    if want[0].isupper():  # a known JAX error
      with self.assertRaises(Exception) as e:
        measure(self, prog, mode, policy, kernel, jit)
      self.assertEqual(type(e.exception).__name__, want)
      return
    self.assertEqual(measure(self, prog, mode, policy, kernel, jit), want)


@jtu.with_config(jax_remat3=True, jax_custom_vjp3=True)
class CustomVJPRematTodayTest(_LaunchTestCase):
  """What optimize_remat=False and True, and defremat by hand, do: the same
  with and without the change."""

  @parameterized.product(mode=['default', 'true', 'defremat'],
                         policy=list(POLICIES), kernel=list(KERNELS),
                         jit=[False, True])
  def test_launches(self, mode, policy, kernel, jit):
    if mode == 'defremat' and not hasattr(jax.custom_vjp, 'defremat'):
      self.skipTest('custom_vjp.defremat is new in jax 0.12')
    self.check('plain', mode, policy, kernel, jit)

  @parameterized.product(prog=PROGRAMS, policy=['nothing', 'names'],
                         kernel=list(KERNELS), jit=[False, True])
  def test_launches_default_rule(self, prog, policy, kernel, jit):
    self.check(prog, 'default', policy, kernel, jit)

  @parameterized.product(mode=['default', 'true'],
                         policy=['nothing', 'dots', 'names'],
                         jit=[False, True])
  def test_grad_of_grad(self, mode, policy, jit):
    self.assertEqual(grad_of_grad(self, mode, policy, jit),
                     expected_grad_of_grad(mode, policy, jit))

  def test_symbolic_zeros_under_default_rule(self):
    if not EVERYTHING_BYPASSES_REMAT:
      self.skipTest('jax 0.11 calls fwd without CustomVJPPrimal under remat3')
    F, seen = symbolic_zeros_function('default')
    self.assertEqual(run_symbolic_zeros(self, F, 'nothing'), 'fwd 2, bwd 1')
    self.assertEqual(seen, [(True, True)])  # flags unknown before autodiff


@jtu.with_config(jax_remat3=True, jax_custom_vjp3=True)
class CustomVJPRematPolicyTest(_LaunchTestCase):
  """optimize_remat='policy' (part 1 of the change)."""

  @parameterized.product(policy=list(POLICIES), kernel=list(KERNELS),
                         jit=[False, True])
  def test_launches(self, policy, kernel, jit):
    self.check('plain', 'policy', policy, kernel, jit)

  @parameterized.product(prog=PROGRAMS, policy=['nothing', 'names'],
                         kernel=list(KERNELS), jit=[False, True])
  def test_launches_programs(self, prog, policy, kernel, jit):
    self.check(prog, 'policy', policy, kernel, jit)

  @parameterized.product(policy=['nothing', 'dots', 'names'],
                         jit=[False, True])
  def test_grad_of_grad(self, policy, jit):
    self.assertEqual(grad_of_grad(self, 'policy', policy, jit),
                     expected_grad_of_grad('policy', policy, jit))

  def test_symbolic_zeros_nothing_saved(self):
    # fwd runs during differentiation, where jax 0.12 knows which inputs are
    # perturbed (0.11's remat3 treats every input of the region as one).
    F, seen = symbolic_zeros_function('policy')
    self.assertEqual(run_symbolic_zeros(self, F, 'nothing'),
                     'f 1, fwd 1, bwd 1')
    self.assertEqual(seen, [(True, not EVERYTHING_BYPASSES_REMAT)])

  def test_symbolic_zeros_saved_residual_raises(self):
    F, _ = symbolic_zeros_function('policy', named=True)
    with self.assertRaisesRegex(NotImplementedError, 'perturbed'):
      run_symbolic_zeros(self, F, 'names')

  def test_optimize_remat_values(self):
    f = jax.custom_vjp(jnp.sin)
    with self.assertRaisesRegex(ValueError, "'policy'"):
      f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g,),
               optimize_remat='always')

  def test_decision_traced_once_per_signature(self):
    # The decision traces fwd once on a throwaway trace; a second eager step
    # with the same policy and types reuses it. fwd is also traced in the
    # backward region of every step (as with optimize_remat=True).
    traces = collections.Counter()
    def count_traces(mode):
      F = jax.custom_vjp(jnp.sin)
      def fwd(x):
        traces[mode] += 1
        return jnp.sin(x), jnp.cos(x)
      F.defvjp(fwd, lambda c, g: (c * g,), optimize_remat=mode)
      policy = jax.checkpoint_policies.dots_saveable
      step = jax.grad(lambda x: jax.checkpoint(F, policy=policy)(x).sum())
      x = jnp.linspace(0.1, 0.9, 8, dtype=jnp.float32)
      for _ in range(2):
        self.assertAllClose(step(x), jnp.cos(x))
    count_traces(True)
    count_traces('policy')
    self.assertEqual(traces['policy'], traces[True] + 1)

  def test_unhashable_static_argument(self):
    # a list as nondiff argument: no caching, same schedule
    F = jax.custom_vjp(lambda x, ks: callback_kernel(
        'f', numpy_rule('f'), [x], x)[0], nondiff_argnums=(1,))
    def fwd(x, ks):
      return tuple(callback_kernel('fwd', numpy_rule('fwd'), [x, x], x))
    bwd = lambda ks, c, g: (callback_kernel('bwd', numpy_rule('bwd'), [g],
                                            c, g)[0],)
    F.defvjp(fwd, bwd, optimize_remat='policy')
    policy = jax.checkpoint_policies.dots_saveable
    step = jax.value_and_grad(lambda x: jax.checkpoint(
        lambda x: F(x, [1, 2]), policy=policy)(x).sum())
    x = jnp.linspace(0.1, 0.9, 8, dtype=jnp.float32)
    COUNTS.clear()
    _, grad = step(x)
    self.assertAllClose(grad, jnp.cos(x))
    self.assertEqual(format_counts(COUNTS), 'f 1, fwd 1, bwd 1')

  def test_partly_saved_residuals_replay_the_rest(self):
    # dots_saveable saves x @ w inside a JAX-coded fwd, but not tanh of it:
    # fwd runs forward, and the rem side recomputes only what was not saved.
    def reference(x, w):
      return jnp.tanh(x @ w)
    F = jax.custom_vjp(reference)
    def fwd(x, w):
      t = jnp.tanh(x @ w)
      return t, (x, w, t)
    def bwd(res, g):
      x, w, t = res
      d = g * (1 - t ** 2)
      return d @ w.T, x.T @ d
    F.defvjp(fwd, bwd, optimize_remat='policy')
    policy = jax.checkpoint_policies.dots_saveable
    loss = lambda F: lambda x, w: jax.checkpoint(F, policy=policy)(x, w).sum()
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 6
    w = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 12
    for jit in (False, True):
      grad = jax.grad(loss(F), argnums=(0, 1))
      grad = jax.jit(grad) if jit else grad
      self.assertAllClose(grad(x, w), jax.grad(loss(reference), (0, 1))(x, w))


@jtu.with_config(jax_remat3=True, jax_custom_vjp3=True)
class CustomVJPRematFusedTest(_LaunchTestCase):
  """defvjp(..., fwd_bwd=...) (part 2 of the change)."""

  @parameterized.product(mode=['policy_fused', 'true_fused'],
                         policy=list(POLICIES), kernel=list(KERNELS),
                         jit=[False, True])
  def test_launches(self, mode, policy, kernel, jit):
    self.check('plain', mode, policy, kernel, jit)

  @parameterized.product(prog=PROGRAMS, policy=['nothing', 'names'],
                         kernel=list(KERNELS), jit=[False, True])
  def test_launches_programs(self, prog, policy, kernel, jit):
    self.check(prog, 'policy_fused', policy, kernel, jit)

  @parameterized.product(policy=['nothing', 'dots', 'names'],
                         jit=[False, True])
  def test_grad_of_grad(self, policy, jit):
    self.assertEqual(grad_of_grad(self, 'policy_fused', policy, jit),
                     expected_grad_of_grad('policy_fused', policy, jit))

  def test_symbolic_zeros_nothing_saved(self):
    F, _ = symbolic_zeros_function('policy_fused')
    self.assertEqual(run_symbolic_zeros(self, F, 'nothing'), 'f 1, fwd_bwd 1')

  def test_fwd_bwd_needs_optimize_remat(self):
    f = jax.custom_vjp(jnp.sin)
    with self.assertRaisesRegex(ValueError, 'fwd_bwd'):
      f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g,),
               fwd_bwd=lambda x, g: (g,))


def expected_grad_of_grad(mode, policy, jit):
  """Taps counted in ``grad_of_grad``: JAX-coded rules, so dead-code
  elimination removes taps whose outputs are unused (under jit, bwd's primal
  output is unused at second order). The schedules that run f forward
  ('true', and 'policy' where nothing is saved) run fwd and bwd, or fwd_bwd,
  in the region, which a second derivative differentiates again."""
  primal_schedule = mode == 'true' or (mode != 'default' and policy != 'names')
  if jit:
    return 'fwd 1, bwd 1' if primal_schedule else 'fwd 1'
  if not primal_schedule:
    return 'fwd 1, bwd 1'
  return 'fwd 1, bwd 1, fwd_bwd 1' if mode == 'policy_fused' else 'fwd 1, bwd 2'


class CustomVJPPolicyElsewhereTest(_LaunchTestCase):
  """Without both remat3 flags, optimize_remat='policy' acts as False."""

  @parameterized.product(custom_vjp3=[False, True], kernel=list(KERNELS),
                         jit=[False, True])
  def test_launches(self, custom_vjp3, kernel, jit):
    with config.remat3(False), config.custom_vjp3(custom_vjp3):
      for mode in ('default', 'policy'):
        self.assertEqual(measure(self, 'plain', mode, 'nothing', kernel, jit),
                         'fwd 2, bwd 1')

  def test_symbolic_zeros(self):
    with config.remat3(False), config.custom_vjp3(False):
      F, seen = symbolic_zeros_function('policy')
      self.assertEqual(run_symbolic_zeros(self, F, 'nothing'), 'fwd 2, bwd 1')
    self.assertEqual(set(seen), {(True, False)})


def symbolic_zeros_function(mode, named=False):
  """``F(x, w) = sin(x) w`` with ``symbolic_zeros=True`` and kernel rules;
  ``seen`` gets the perturbed flags of each call of fwd. (Under a policy of
  None no throwaway trace decides, so every call is one that runs.)"""
  seen = []
  def f(x, w):
    return callback_kernel('f', lambda x, w: (np.sin(x) * w,), [x], x, w)[0]
  def fwd(x, w):
    flags = (x.perturbed, w.perturbed)
    x, w = x.value, w.value
    y, c = callback_kernel(
        'fwd', lambda x, w: (np.sin(x) * w, np.cos(x) * w), [x, x], x, w)
    seen.append(flags)
    return y, checkpoint_name(c, 'c') if named else c
  def bwd(c, g):
    return callback_kernel('bwd', lambda c, g: (c * g,), [g], c, g)[0], None
  def fwd_bwd(x, w, g):
    return callback_kernel('fwd_bwd', lambda x, w, g: (np.cos(x) * w * g,),
                           [g], x, w, g)[0], None
  F = jax.custom_vjp(f)
  kw = dict(default={}, policy=dict(optimize_remat='policy'),
            policy_fused=dict(optimize_remat='policy', fwd_bwd=fwd_bwd))[mode]
  F.defvjp(fwd, bwd, symbolic_zeros=True, **kw)
  return F, seen


def run_symbolic_zeros(test, F, policy):
  """Launches of a gradient step in ``x`` only (``w`` is not perturbed)."""
  w = jnp.float32(2.0)
  step = jax.value_and_grad(lambda x: jax.checkpoint(
      lambda x: F(x, w), policy=POLICIES[policy])(x).sum())
  x = jnp.linspace(0.1, 0.9, 8, dtype=jnp.float32)
  COUNTS.clear()
  value, grad = step(x)
  counts = dict(COUNTS)
  test.assertAllClose(value, (jnp.sin(x) * w).sum())
  test.assertAllClose(grad, jnp.cos(x) * w)
  return format_counts(counts)


if __name__ == '__main__':
  absltest.main(testLoader=jtu.JaxTestLoader())
