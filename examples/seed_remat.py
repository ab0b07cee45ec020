"""The seed program (jax-ml/jax#21303) with counting kernels, side by side.

"The seed program" is the program of jax-ml/jax#21303, the report this
project answers: ``F(x) = sin(x)`` as a ``jax.custom_vjp`` whose three rules
(``f``, ``fwd``, ``bwd``) print when they run, differentiated through
``jax.remat(F)``; it prints ``f_bwd, f_fwd, f_fwd``, where one ``f``, one
``fwd`` and one ``bwd`` were expected. The rows below are that program and
its neighbours (scan, a named residual saved by a policy, a fused rule).

Under ``jax.remat``, ``jax.custom_vjp`` runs ``fwd`` twice and ``f`` never;
``smart_custom_vjp`` runs ``f`` in the forward pass and ``fwd`` once, in the
backward pass. The rules here are Pallas kernels (``interpret=True``, so this
runs on a CPU) that count their launches with a ``jax.debug.callback``. The
callback keeps every launch; a real kernel is removed only when all of its
outputs are unused. Here ``fwd``'s primal output is always used, and a kernel
cannot be split, so its extra launch, residual writes included, is real.

Run:  python examples/seed_remat.py
"""

from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from smartvjp import smart_custom_vjp

LAUNCHES: collections.Counter = collections.Counter()


def _counted(name, body):
  """A Pallas kernel that runs ``body`` on whole refs and counts its launch."""
  def kernel(*refs):
    jax.debug.callback(lambda: LAUNCHES.update([name]))
    body(*refs)
  return kernel


def _pallas(name, body, out_like, *args):
  outs = pl.pallas_call(
      _counted(name, body),
      out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_like],
      interpret=True)(*args)
  return outs


# -- the seed's rules as kernels ----------------------------------------------

def f_kernel(x):
  def body(x_ref, y_ref):
    y_ref[...] = jnp.sin(x_ref[...])
  return _pallas("f", body, [x], x)[0]


def fwd_kernel(x):  # writes the primal and a residual (cos x) to memory
  def body(x_ref, y_ref, c_ref):
    y_ref[...] = jnp.sin(x_ref[...])
    c_ref[...] = jnp.cos(x_ref[...])
  return _pallas("fwd", body, [x, x], x)


def fwd_kernel_no_res(x):  # the seed's literal fwd: only the primal
  def body(x_ref, y_ref):
    y_ref[...] = jnp.sin(x_ref[...])
  return _pallas("fwd", body, [x], x)[0]


def bwd_kernel(c, g):
  def body(c_ref, g_ref, dx_ref):
    dx_ref[...] = c_ref[...] * g_ref[...]
  return _pallas("bwd", body, [g], c, g)[0]


def bwd_kernel_from_x(x, g):
  def body(x_ref, g_ref, dx_ref):
    dx_ref[...] = jnp.cos(x_ref[...]) * g_ref[...]  # "do the cosine here"
  return _pallas("bwd", body, [g], x, g)[0]


def fwd_bwd_kernel(x, g):
  """Fused rule: recomputes what it needs from x, writes no residual."""
  def body(x_ref, g_ref, dx_ref):
    dx_ref[...] = jnp.cos(x_ref[...]) * g_ref[...]
  return (_pallas("fwd_bwd", body, [g], x, g)[0],)


# -- rule sets ------------------------------------------------------------------

def seed_rules():
  """The seed's literal fwd: residual is the input x."""
  def fwd(x):
    return fwd_kernel_no_res(x), (x,)

  def bwd(res, g):
    (x,) = res
    return (bwd_kernel_from_x(x, g),)
  return fwd, bwd


def computed_rules(name=None):
  """A fwd that computes its residual (cos x), optionally checkpoint_name'd."""
  def fwd(x):
    y, c = fwd_kernel(x)
    return y, (checkpoint_name(c, name) if name else c,)

  def bwd(res, g):
    (c,) = res
    return (bwd_kernel(c, g),)
  return fwd, bwd


def make(impl, rules, fused=False):
  fwd, bwd = rules
  if impl == "smartvjp":
    F = smart_custom_vjp(f_kernel)
    F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd_kernel if fused else None)
  else:
    if fused:
      return None
    F = jax.custom_vjp(f_kernel)
    F.defvjp(fwd, bwd, optimize_remat=(impl == "optimize_remat"))
  return F


def remat_loss(F, policy=None):
  return lambda x: jnp.sum(jax.checkpoint(F, policy=policy)(x) ** 2)


def scan_loss(F):
  def body(c, _):
    return jax.checkpoint(F)(c), None
  return lambda x: jnp.sum(jax.lax.scan(body, x, None, length=4)[0] ** 2)


CASES = [
    ("jit(grad(F)), no remat", computed_rules, {}, lambda F: jax.jit(
        jax.grad(lambda x: jnp.sum(F(x) ** 2)))),
    ("jit(grad(remat(F))), seed's fwd (residual = x)", seed_rules, {},
     lambda F: jax.jit(jax.grad(remat_loss(F)))),
    ("jit(grad(remat(F))), fwd computes its residual", computed_rules, {},
     lambda F: jax.jit(jax.grad(remat_loss(F)))),
    ("grad(remat(F)), eager", computed_rules, {},
     lambda F: jax.grad(remat_loss(F))),
    ("scan of 4 remat(F) layers", computed_rules, {},
     lambda F: jax.jit(jax.grad(scan_loss(F)))),
    ("named residual, save_only_these_names", lambda: computed_rules("res"), {},
     lambda F: jax.jit(jax.grad(remat_loss(
         F, jax.checkpoint_policies.save_only_these_names("res"))))),
    ("remat(F) with fused fwd_bwd", computed_rules, {"fused": True},
     lambda F: jax.jit(jax.grad(remat_loss(F)))),
]
IMPLS = ["jax.custom_vjp", "optimize_remat", "smartvjp"]
# cases where jax.custom_vjp has no such API, and the case that runs the same
# program without it (what optimize_remat=True does instead)
WITHOUT_API = {"remat(F) with fused fwd_bwd":
               "jit(grad(remat(F))), fwd computes its residual"}
# why smartvjp runs fewer kernels than optimize_remat=True, where it does
WHY = {
    "named residual, save_only_these_names":
        "the policy saves the residual named \"res\": smartvjp runs fwd in "
        "the forward pass and keeps it;\n    optimize_remat=True does not "
        "follow the policy: it runs f forward and fwd again in the backward "
        "pass",
    "remat(F) with fused fwd_bwd":
        "a fused fwd_bwd recomputes in one kernel what bwd needs and writes "
        "no residual; jax.custom_vjp\n    takes no fused rule, so "
        "optimize_remat=True runs fwd + bwd in the backward pass",
}


def measure(x):
  """Returns ``{(case, impl): (counts, grad or None, error or None)}``."""
  table = {}
  for case, rules, kw, program in CASES:
    for impl in IMPLS:
      F = make(impl, rules(), **kw)
      if F is None:
        table[case, impl] = (None, None, "not in API")
        continue
      LAUNCHES.clear()
      try:
        g = jax.block_until_ready(program(F)(x))
        table[case, impl] = (dict(LAUNCHES), g, None)
      except Exception as e:  # noqa: BLE001 - shown in the table
        table[case, impl] = (None, None, f"{type(e).__name__}")
  return table


def fmt_counts(c):
  order = ["f", "fwd", "bwd", "fwd_bwd"]
  return ", ".join(f"{k} {c[k]}" for k in order if c.get(k)) or "none"


def against_optimize_remat(table):
  """``(wins, losses, ties)``: the cases where smartvjp runs fewer kernel
  launches than ``optimize_remat=True`` (or it raises), more, or as many;
  each ``(case, smartvjp counts, optimize_remat counts, note)``."""
  wins, losses, ties = [], [], []
  for case, *_ in CASES:
    counts, _, err = table[case, "smartvjp"]
    other, note = case, ""
    if table[case, "optimize_remat"][2] == "not in API":
      other = WITHOUT_API[case]
      note = " (no fused rule: the same program without one)"
    opt, _, opt_err = table[other, "optimize_remat"]
    if err:
      losses.append((case, None, opt, note))
    elif opt_err:
      wins.append((case, counts, None, f" (raises {opt_err})"))
    elif sum(counts.values()) < sum(opt.values()):
      wins.append((case, counts, opt, note))
    elif sum(counts.values()) > sum(opt.values()):
      losses.append((case, counts, opt, note))
    else:
      ties.append((case, counts, opt, note))
  return wins, losses, ties


def _launches(c):
  return ("an error" if c is None
          else f"{fmt_counts(c)} ({sum(c.values())} launches)")


def main():
  t0 = time.perf_counter()
  x = jnp.linspace(-1.0, 2.0, 8, dtype=jnp.float32)
  table = measure(x)
  plain = lambda x: jnp.sin(x)
  width = max(len(c) for c, *_ in CASES)
  print("The seed program is jax-ml/jax#21303's, the report this project "
        "answers: F(x) = sin(x) as a custom VJP with\nrules f, fwd and bwd, "
        "differentiated through jax.remat(F), where jax.custom_vjp runs fwd "
        "twice and f never.\n")
  print(f"Kernel launches per gradient step (jax {jax.__version__}, "
        f"{jax.devices()[0].platform}), counted by a callback in each kernel.\n"
        "Each rule (f, fwd, bwd, fwd_bwd) is one Pallas kernel (interpret "
        "mode; F's output is used, so a real kernel\nwould run as often), so "
        "these counts are also rule calls.\n")
  print(f"{'program':<{width}} | " + " | ".join(f"{i:<22}" for i in IMPLS))
  print("-" * (width + 3 + 25 * len(IMPLS)))
  checked = mismatched = 0
  for case, _, _, program in CASES:
    reference = program(plain)(x)
    cells = []
    for impl in IMPLS:
      counts, g, err = table[case, impl]
      if err:
        cells.append(f"— ({err})"[:24])
      else:
        ok = bool(jnp.allclose(g, reference, rtol=1e-5, atol=1e-6))
        checked, mismatched = checked + 1, mismatched + (not ok)
        cells.append(f"{fmt_counts(counts)}{'' if ok else ' WRONG'}")
    print(f"{case:<{width}} | " + " | ".join(f"{c:<22}" for c in cells))
  skipped = len(CASES) * len(IMPLS) - checked
  verdict = ((f"all {checked} match" if not mismatched
              else f"{mismatched} of {checked} do not (marked WRONG)")
             + f" ({checked} = the table's cells that ran"
             + (f"; {skipped} refused, shown as —" if skipped else "") + ")")
  print(f"\nGradients compared with the same program on plain jnp.sin "
        f"(jnp.allclose, rtol 1e-5, atol 1e-6): {verdict}.")

  wins, losses, ties = against_optimize_remat(table)
  print("\nWhere smartvjp beats jax.custom_vjp(optimize_remat=True) "
        "(fewer kernel launches in the same program):")
  for case, mine, opt, note in wins:
    print(f"  {case}: smartvjp {_launches(mine)}, optimize_remat "
          f"{_launches(opt)}{note}")
    if case in WHY:
      print(f"    {WHY[case]}.")
  if not wins:
    print("  no row")
  for case, mine, opt, note in losses:
    print(f"  Where optimize_remat=True runs fewer: {case}: smartvjp "
          f"{_launches(mine)}, optimize_remat {_launches(opt)}{note}")
  print(f"In the other {len(ties)} rows both run the same kernels.")
  print("\nWhat to conclude: under jax.remat, jax.custom_vjp runs fwd in "
        "both passes where fwd computes a\nresidual (the seed's report, "
        "for a kernel's fwd; which rows that is depends on the JAX version\n"
        "printed above); optimize_remat=True and smartvjp both run f forward "
        "and fwd once, backward.\nChoose smartvjp over optimize_remat=True when a policy "
        "saves some of a call's residuals (by name,\nas above, or dots: see "
        "benchmarks/cost.py) or when you have a fused fwd_bwd kernel: there "
        "it runs\nfewer kernels.")
  print(f"Finished in {time.perf_counter() - t0:.1f} s.")
  return table


if __name__ == "__main__":
  main()
