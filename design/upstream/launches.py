#!/usr/bin/env python3
"""Launches per step of a custom_vjp function under jax.checkpoint.

Prints a markdown table: for each program, kernel kind, checkpoint policy and
eager/jit, the kernel runs of one ``value_and_grad`` step, per way of
defining the rules (``False``: the default rule; ``True``, which follows the
policy with the series applied; ``custom_remat``: the fused schedule written
by hand with ``jax.custom_remat``, where the JAX has it). The function is
``sin``; its ``f``, ``fwd``, ``bwd`` (and ``fwd_bwd``) are one host kernel
each, counted by the host, of two kinds:

* ``callback``: a ``pure_callback``, which dead-code elimination removes when
  its outputs are unused (as it removes a ``pallas_call``);
* ``never_dce``: a primitive whose DCE rule keeps it, lowered to a
  side-effecting host callback (as a kernel with side effects): nothing
  removes it.

Gradients are checked against ``jnp.cos``'s. Runs against the JAX it
imports, with the ``jax_remat3`` and ``jax_custom_vjp3`` flags on (``--no-flags``
leaves them off). Usage: ``python launches.py --modes False,True``.
"""

import argparse
import collections
import functools
import json

import numpy as np

import jax
from jax import lax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
try:  # jax 0.12.1 ships it; older JAX does not
  from jax.ad_checkpoint import checkpoint_name_fwd
except ImportError:
  checkpoint_name_fwd = None
from jax.experimental import io_callback
from jax._src import core
from jax._src import dispatch
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe

COUNTS = collections.Counter()
RULES = ('f', 'fwd', 'bwd', 'fwd_bwd')
BODIES = dict(
    f=lambda x: (np.sin(x),),
    fwd=lambda x: (np.sin(x), np.cos(x)),
    bwd=lambda c, g: (c * g,),
    fwd_bwd=lambda x, g: (np.cos(x) * g,))


@functools.cache  # one callable per rule: compiled once
def _host(rule):
  def run(*args):
    COUNTS[rule] += 1
    return tuple(np.asarray(o, np.float32)
                 for o in BODIES[rule](*map(np.asarray, args)))
  return run


def _n_out(rule):
  return 2 if rule == 'fwd' else 1


def callback_kernel(rule, *args):
  like = jax.ShapeDtypeStruct(args[0].shape, jnp.float32)
  return jax.pure_callback(_host(rule), (like,) * _n_out(rule), *args,
                           vmap_method='broadcast_all')


kernel_p = core.Primitive('never_dce_kernel')
kernel_p.multiple_results = True
kernel_p.def_abstract_eval(
    lambda *args, rule: [core.ShapedArray(args[0].shape, np.float32)] * _n_out(rule))
kernel_p.def_impl(functools.partial(dispatch.apply_primitive, kernel_p))


def _lowering(*args, rule):
  like = jax.ShapeDtypeStruct(args[0].shape, jnp.float32)
  return io_callback(_host(rule), (like,) * _n_out(rule), *args, ordered=False)


mlir.register_lowering(kernel_p, mlir.lower_fun(_lowering, multiple_results=True))
# Never removed: every input and the equation are kept.
pe.dce_rules[kernel_p] = lambda *args: ([True] * len(args[-1].invars), args[-1])


def _batch(args, dims, *, rule):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)]
  return kernel_p.bind(*args, rule=rule), [0] * _n_out(rule)


batching.primitive_batchers[kernel_p] = _batch


def never_dce_kernel(rule, *args):
  return tuple(kernel_p.bind(*args, rule=rule))


KERNELS = dict(callback=callback_kernel, never_dce=never_dce_kernel)
POLICIES = dict(
    nothing=None,
    everything=jax.checkpoint_policies.everything_saveable,
    dots=jax.checkpoint_policies.dots_saveable,
    names=jax.checkpoint_policies.save_only_these_names('c'),
    offload=jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=['c'],
        offload_src='device', offload_dst='pinned_host'))
# What fwd names its residual with (--name).
NAMERS = dict(checkpoint_name=checkpoint_name,
              checkpoint_name_fwd=checkpoint_name_fwd)
NAMER = [checkpoint_name]
PROGRAMS = ('plain', 'scan4', 'static', 'vmap_outside', 'vmap_inside',
            'uses_output', 'cond', 'const_in_fwd', 'unnamed_res')


def make_sin(kernel, mode, static=False, const=False, unnamed=False):
  K = KERNELS[kernel]
  if mode == 'custom_remat':  # f forward, fwd_bwd backward, by hand
    f = lambda x: K('f', x)[0]
    return jax.custom_remat(f, lambda policy, x: (f(x), x),
                            lambda x, x_: (f(x_), x_),
                            lambda x, g: (K('fwd_bwd', x, g)[0],))
  def f(*args):
    return K('f', args[-1])[0]
  def fwd(*args):  # with const, an array constant multiplies x first
    x = args[-1] * np.ones(args[-1].shape, np.float32) if const else args[-1]
    y, c = K('fwd', x)
    c = NAMER[0](c, 'c')
    # with unnamed, a second residual computed in JAX from x, not named
    return y, ((c, args[-1] * 2.) if unnamed else c)
  def bwd(*args):
    res, g = args[-2:]
    if unnamed:  # bwd reads the unnamed residual too (adding zero)
      (res, r) = res
      return (K('bwd', res, g)[0] + 0. * r,)
    return (K('bwd', res, g)[0],)
  sin = jax.custom_vjp(f, nondiff_argnums=(0,) if static else ())
  sin.defvjp(fwd, bwd, optimize_remat={'False': False, 'True': True}.get(mode, mode))
  return (lambda x: sin('static', x)) if static else sin


def make_step(program, sin, policy):
  ckpt = lambda g: jax.checkpoint(g, policy=POLICIES[policy])
  if program in ('plain', 'static', 'const_in_fwd', 'unnamed_res'):
    return jax.value_and_grad(ckpt(lambda x: sin(x).sum()))
  if program == 'uses_output':
    return jax.value_and_grad(ckpt(lambda x: (sin(x) * jnp.cos(x)).sum()))
  if program == 'scan4':
    def loss(x):
      return lax.scan(lambda c, _: (ckpt(sin)(c), None), x, None,
                      length=4)[0].sum()
    return jax.value_and_grad(loss)
  if program == 'cond':
    return jax.value_and_grad(ckpt(
        lambda x: lax.cond(x.sum() > -1., sin, jnp.sin, x).sum()))
  if program == 'vmap_outside':
    return jax.vmap(jax.value_and_grad(ckpt(lambda x: sin(x).sum())))
  if program == 'vmap_inside':
    return jax.value_and_grad(ckpt(lambda x: jax.vmap(sin)(x).sum()))
  raise ValueError(program)


def expected_grad(program, x):
  if program == 'scan4':
    return jax.grad(lambda x: lax.fori_loop(0, 4, lambda _, c: jnp.sin(c),
                                            x).sum())(x)
  if program == 'uses_output':
    return jax.grad(lambda x: (jnp.sin(x) * jnp.cos(x)).sum())(x)
  return jnp.cos(x)


def measure(program, mode, policy, kernel, jit):
  sin = make_sin(kernel, mode, static=program == 'static',
                 const=program == 'const_in_fwd',
                 unnamed=program == 'unnamed_res')
  step = make_step(program, sin, policy)
  x = jnp.linspace(0.1, 0.9, 8, dtype=jnp.float32)
  if program.startswith('vmap'):
    x = x.reshape(2, 4)
  run = jax.jit(step) if jit else step
  jax.block_until_ready(run(x))  # compiles
  COUNTS.clear()
  _, g = jax.block_until_ready(run(x))
  counts = dict(COUNTS)
  np.testing.assert_allclose(g, expected_grad(program, x), rtol=1e-5,
                             atol=1e-6)
  return counts


def describe(counts):
  return ', '.join(f'{r} {counts[r]}' for r in RULES if counts.get(r)) or '-'


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--modes', default='False,True')
  ap.add_argument('--programs', default='plain')
  ap.add_argument('--kernels', default='callback,never_dce')
  ap.add_argument('--policies', default='nothing,everything,dots,names,offload')
  ap.add_argument('--jit', default='eager,jit')
  ap.add_argument('--no-flags', action='store_true')
  ap.add_argument('--name', choices=tuple(NAMERS), default='checkpoint_name',
                  help="what fwd names its residual with")
  ap.add_argument('--json', help='also write the cells here')
  args = ap.parse_args(argv)
  if not args.no_flags:
    jax.config.update('jax_remat3', True)
    jax.config.update('jax_custom_vjp3', True)
  if NAMERS[args.name] is None:
    raise SystemExit(f'this JAX has no jax.ad_checkpoint.{args.name}')
  NAMER[0] = NAMERS[args.name]
  modes = args.modes.split(',')
  print(f'jax {jax.__version__} ({jax.__file__}), '
        f'remat3 flags {"off" if args.no_flags else "on"}, fwd names its '
        f'residual with {args.name}')
  print('| program | kernel | policy | | ' + ' | '.join(modes) + ' |')
  print('|---' * (4 + len(modes)) + '|')
  cells = []
  for program in args.programs.split(','):
    for kernel in args.kernels.split(','):
      for policy in args.policies.split(','):
        for how in args.jit.split(','):
          row = []
          for mode in modes:
            try:
              got = describe(measure(program, mode, policy, kernel, how == 'jit'))
            except Exception as e:  # noqa: BLE001 -- the table shows it
              got = type(e).__name__
            row.append(got)
            cells.append(dict(program=program, kernel=kernel, policy=policy,
                              jit=how, mode=mode, launches=got))
          print(f'| {program} | {kernel} | {policy} | {how} | '
                + ' | '.join(row) + ' |', flush=True)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(cells, f, indent=1)


if __name__ == '__main__':
  main()
