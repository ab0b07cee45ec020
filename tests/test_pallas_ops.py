"""JAX's shipped Pallas kernels, as shipped and swapped by
``smartvjp.import_swapped``: launches per kernel (the minimum: under
``jax.checkpoint`` the kernel without residual outputs forward and the
residual-writing kernel once, backward) and gradients bit for bit equal to
the shipped kernels', under ``jit`` and eager, ``scan`` and ``vmap``.

Launches are counted twice, independently (``shipped_kernels.py``): in the
program JAX lowers for a GPU (no GPU needed), and at run time in interpret
mode; the ``jit`` programs check that the two agree. The lowered-program
counter is also checked on its own against known cases (dead code, loops,
conditionals). On a GPU, the last tests compare the profiler's kernel
launches with the lowered program's and the gradients of the real kernels.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
import shipped_kernels as SK
import smartvjp

EX = SK.load_example()
KERNEL_IDS = list(SK.KERNELS)
SCHEDULES = ("shipped", "swapped")
# JAX 0.11 deprecates Pallas' Triton backend, and 0.10.2+ the GPU ops modules.
pytestmark = [
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def loss_fn(kernel, module, interpret, policy=None, layers=None):
  """``loss(*args)``: ``sum(F(*args) ** 2)``, ``F`` the kernel call,
  checkpointed with ``policy`` unless ``policy`` is "none"; with ``layers``,
  a ``lax.scan`` of that many checkpointed calls, each on scaled inputs."""
  def call(*args):
    return kernel.call(module, *args, interpret=interpret)
  if policy != "none":
    call = jax.checkpoint(call, policy=policy)
  if layers is None:
    return lambda *args: jnp.sum(call(*args) ** 2)

  def loss(*args):
    def body(total, scale):
      return total + jnp.sum(call(args[0] * scale, *args[1:]) ** 2), None
    total, _ = jax.lax.scan(body, 0.0, jnp.linspace(0.5, 1.5, layers))
    return total
  return loss


def grad_fn(kernel, module, interpret, **kw):
  n = len(kernel.args())
  return jax.grad(loss_fn(kernel, module, interpret, **kw),
                  argnums=tuple(range(n)))


def assert_bitwise(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    assert np.array_equal(np.asarray(x).view(np.uint32),
                          np.asarray(y).view(np.uint32)), (x, y)


# -- the swap takes on every shipped kernel module -----------------------------------

SHIPPED_MODULES = {
    "jax.experimental.pallas.ops.gpu.attention": ("mha",),     # SK.TRITON
    "jax.experimental.pallas.ops.gpu.rms_norm": ("rms_norm",),
    "jax.experimental.pallas.ops.gpu.layer_norm": ("layer_norm",),
    "jax.experimental.pallas.ops.tpu.flash_attention": ("_flash_attention",),
    # the package: megablox/ops.py reads the submodule gmm from its package
    # as its package's __init__ runs, before the function gmm shadows it
    "jax.experimental.pallas.ops.tpu.megablox": ("gmm", "ops.gmm"),
}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[SK.TRITON] if ".ops.gpu." in n else [])
    for n in SHIPPED_MODULES])
def test_every_shipped_custom_vjp_kernel_module_swaps(name):
  shipped = SK.load(name, swapped=False)
  swapped = SK.load(name, swapped=True)
  for fn in SHIPPED_MODULES[name]:
    assert swap_is(shipped, fn) is False and swap_is(swapped, fn) is True
  assert all(smartvjp.swap_report(swapped).values())
  assert importlib.import_module(name) is shipped   # the shared module stays


def swap_is(module, fn):
  return smartvjp.swap_report(module)[f"{module.__name__}.{fn}"]


# -- launches in the lowered GPU program, per kernel and schedule -------------------

PROGRAMS = {
    # program: (policy, layers, vmap batch, rule calls per schedule)
    "no remat": ("none", None, None, SK.NO_REMAT),
    "checkpoint": (None, None, None, SK.REMAT),
    "dots_saveable": (jax.checkpoint_policies.dots_saveable, None, None,
                      SK.REMAT),
    "everything_saveable": (jax.checkpoint_policies.everything_saveable, None,
                            None, SK.NO_REMAT),
    "scan of 3": (None, 3, None, {s: SK.scaled(r, 3) for s, r in
                                  SK.REMAT.items()}),
    "vmap": (None, None, 2, SK.REMAT),
}


@pytest.fixture(scope="module")
def modules():
  return {(k, s): SK.load(SK.KERNELS[k].module, s == "swapped")
          for k in KERNEL_IDS for s in SCHEDULES}


@SK.TRITON
@pytest.mark.parametrize("program", list(PROGRAMS))
@pytest.mark.parametrize("kernel_id", KERNEL_IDS)
def test_lowered_launches(modules, kernel_id, program):
  """Per kernel: the program lowered for a GPU launches exactly the
  expected kernels; swapped, the minimum."""
  kernel = SK.KERNELS[kernel_id]
  policy, layers, batch, rule_calls = PROGRAMS[program]
  args = kernel.args()
  for schedule in SCHEDULES:
    fn = grad_fn(kernel, modules[kernel_id, schedule], False, policy=policy,
                 layers=layers)
    if batch:
      fn = jax.vmap(fn)
      args = tuple(jnp.stack([a] * batch) for a in kernel.args())
    got = SK.static_launches(EX, fn, *args)
    assert got == kernel.expected(rule_calls[schedule]), schedule


# -- launches at run time and bitwise gradients, jit and eager ---------------------

MODES = {
    # mode: (jit, layers, vmap batch)
    "jit, scan of 2, vmap": (True, 2, 2),
    "eager": (False, None, None),
}


@SK.TRITON
@pytest.mark.parametrize("kernel_id,mode", [
    (k, m) for k in KERNEL_IDS for m in MODES
    # layer_norm's module is rms_norm's with a mean: eager once is enough
    if (k, m) != ("layer_norm", "eager")])
def test_runtime_launches_and_bitwise_gradients(kernel_id, mode):
  """In interpret mode: the swapped kernels' gradients equal the shipped
  ones bit for bit, and each schedule launches what it should (with ``jit``,
  what the lowered GPU program says too)."""
  kernel = SK.KERNELS[kernel_id]
  jit, layers, batch = MODES[mode]
  args = kernel.args()
  if batch:
    args = tuple(jnp.stack([a, a * 0.5]) for a in args)
  rule_calls = {s: SK.scaled(r, layers or 1) for s, r in SK.REMAT.items()}
  grads = {}
  for schedule in SCHEDULES:
    module = SK.load(kernel.module, schedule == "swapped", counting=True)
    fn = grad_fn(kernel, module, True, layers=layers)
    if batch:
      fn = jax.vmap(fn)
    SK.FIRES.clear()
    grads[schedule] = jax.block_until_ready((jax.jit(fn) if jit else fn)(*args))
    jax.effects_barrier()
    got = SK.runtime_launches(kernel, args[:1] if not batch else
                              tuple(a[0] for a in args), batch or 1)
    assert got == kernel.expected(rule_calls[schedule]), schedule
    if jit:    # the same launches as the program lowered for a GPU
      plain = SK.load(kernel.module, schedule == "swapped")
      lowered = grad_fn(kernel, plain, False, layers=layers)
      assert SK.static_launches(EX, jax.vmap(lowered) if batch else lowered,
                                *args) == got
  assert_bitwise(grads["swapped"], grads["shipped"])


# -- kernels that do not run, or run without counters, on a CPU --------------------

def test_tpu_flash_attention_runs_only_on_a_tpu():
  if jax.default_backend() == "tpu":
    pytest.skip("on a TPU: not covered by this CPU/GPU suite")
  module = SK.load("jax.experimental.pallas.ops.tpu.flash_attention", True)
  q = SK.normal(0, (1, 1, 128, 128))
  try:
    jax.block_until_ready(module.flash_attention(q, q, q))
  except Exception as e:   # noqa: BLE001 -- the reason, verbatim, for the skip
    pytest.skip(f"TPU flash attention takes no interpret argument and does "
                f"not run on {jax.default_backend()}: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}")
  pytest.fail("TPU flash attention ran on a non-TPU backend; test it here")


# -- the lowered-program counter on known cases -------------------------------------

RMS = "jax.experimental.pallas.ops.gpu.rms_norm"


@SK.TRITON
def test_counter_dead_code():
  """A kernel whose outputs are all unused is gone (JAX removes it); one
  with a single used output runs whole; a used one inside a loop counts its
  trip count times."""
  rms = SK.load(RMS, False)
  fwd = lambda x, w, b: rms.rms_norm_forward(x, w, b)
  assert SK.static_launches(
      EX, lambda x, w, b: (fwd(x, w, b), jnp.sum(x))[1], *SK.norm_args()) == {}
  one_output = lambda x, w, b: jnp.sum(fwd(x, w, b)[1][3])   # rstd only
  assert SK.static_launches(EX, one_output, *SK.norm_args()) == {
      ("rms_forward", 2): 1}

  def loop(x, w, b):
    return jax.lax.fori_loop(0, 5, lambda i, x: fwd(x, w, b)[0], x)
  assert SK.static_launches(EX, loop, *SK.norm_args()) == {("rms_forward", 2): 5}

  def from_three(x, w, b):
    return jax.lax.fori_loop(3, 7, lambda i, x: fwd(x, w, b)[0], x)
  assert SK.static_launches(EX, from_three, *SK.norm_args()) == {
      ("rms_forward", 2): 4}


@SK.TRITON
def test_counter_refuses_what_only_run_time_decides():
  rms = SK.load(RMS, False)
  f = lambda x, w, b: rms.rms_norm(x, w, b)

  def while_data(x, w, b):
    return jax.lax.while_loop(lambda x: jnp.sum(x) < 10.0,
                              lambda x: f(x, w, b) + 1.0, x)
  with pytest.raises(EX.LaunchCountError, match="trip count"):
    SK.static_launches(EX, while_data, *SK.norm_args())

  def cond_different(x, w, b):
    return jax.lax.cond(jnp.sum(x) > 0, lambda x: f(x, w, b), lambda x: x, x)
  with pytest.raises(EX.LaunchCountError, match="regions launch different"):
    SK.static_launches(EX, cond_different, *SK.norm_args())

  def cond_same(x, w, b):
    return jax.lax.cond(jnp.sum(x) > 0, lambda x: f(x, w, b),
                        lambda x: f(-x, w, b), x)
  assert SK.static_launches(EX, cond_same, *SK.norm_args()) == {
      ("rms_norm_forward_kernel", 1): 1}


def test_counter_agrees_with_a_kernel_that_counts_itself():
  """The repository's own RMSNorm+GELU kernels count their launches at run
  time (interpret mode); the lowered program of the same step, scanned and
  checkpointed, shows the same launches."""
  import importlib.util
  import os
  path = os.path.join(SK.ROOT, "examples", "pallas_rmsnorm_gelu.py")
  spec = importlib.util.spec_from_file_location("pallas_rmsnorm_gelu", path)
  RG = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(RG)
  x = SK.normal(0, (32, 24))
  gammas = 1.0 + 0.1 * SK.normal(1, (3, 24))

  def step(op):
    def loss(x, gammas):
      layer = jax.checkpoint(op)
      x, _ = jax.lax.scan(lambda x, g: (layer(x, g), None), x, gammas)
      return jnp.sum(x ** 2)
    return jax.grad(loss, (0, 1))

  counting, _ = RG.make_rmsnorm_gelu(block_m=16, fused=False, count=True,
                                     interpret=True)
  RG.LAUNCHES.clear()
  jax.block_until_ready(jax.jit(step(counting))(x, gammas))
  jax.effects_barrier()
  ran = {RG.KERNEL_NAMES[rule][0]: n for rule, n in RG.LAUNCHES.items()}
  assert ran == {"rmsnorm_gelu_f": 3, "rmsnorm_gelu_fwd": 3,
                 "rmsnorm_gelu_bwd": 3}
  lowered_op, _ = RG.make_rmsnorm_gelu(block_m=16, fused=False,
                                       interpret=False)
  lowered = {name: n for (name, _), n in
             SK.static_launches(EX, step(lowered_op), x, gammas).items()}
  assert lowered == ran


# -- on a GPU: the real kernels ---------------------------------------------------

needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu",
                               reason="needs a GPU")


@needs_gpu
@SK.TRITON
@pytest.mark.parametrize("kernel_id", KERNEL_IDS)
def test_gpu_profiler_launches_match_the_lowered_program(kernel_id):
  """Kernel launches the profiler sees in one jitted step (the f and fwd
  kernels of attention share a name there) equal the lowered program's, and
  the gradients of the real kernels are bitwise equal across schedules."""
  kernel = SK.KERNELS[kernel_id]
  args = kernel.args()
  grads = {}
  for schedule in SCHEDULES:
    module = SK.load(kernel.module, schedule == "swapped")
    fn = jax.jit(grad_fn(kernel, module, False, layers=3))
    lowered = SK.static_launches(EX, fn, *args)
    by_name = {}
    for (name, _), n in lowered.items():
      by_name[name] = by_name.get(name, 0) + n
    assert K.gpu_kernel_launches(fn, *args, names=list(by_name)) == by_name
    grads[schedule] = fn(*args)
  assert_bitwise(grads["swapped"], grads["shipped"])
