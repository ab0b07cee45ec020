"""Kernel executions and what works, per transformation, side by side.

Columns: ``jax.custom_vjp``, ``jax.custom_vjp(optimize_remat=True)``, JAX's
experimental ``jax_custom_vjp3`` + ``jax_remat3`` flags, the same flags with
``defvjp`` plus a hand-written ``defremat(lambda x: (f(x), None),
lambda _, x: fwd(x), bwd)`` (jax 0.12 only), smartvjp, and smartvjp under
those same flags (its remat3 rules, ``smartvjp/_remat3.py``). Rows
that count use Pallas ``interpret=True`` kernels that count their launches
(the callback keeps every launch; JAX removes a real kernel only when all
its outputs are unused, and the counted programs use ``F``'s output,
``loss = sum(F(x) ** 2)``; see ``examples/seed_remat.py``);
rows that need differentiable rules use the same rules written in JAX and
report whether the program works and gives the right value.

Deterministic (kernel launches counted, values compared): one run, no spread.
Goal, per row, printed with a verdict (met / not met; n/a where a column
cannot run on this JAX): smartvjp does no more than ``jax.custom_vjp``, and
smartvjp under the remat3 flags no more than ``jax.custom_vjp`` under the
same flags (``vjp3+remat3``). "No more" means: where the anchor gives the
right value, smartvjp does too, with no more kernel launches in all and no
more launches of ``fwd`` or of ``bwd``; where the anchor fails (an error, or
no such API) smartvjp may do anything. The ``fwd_bwd`` row has no anchor (no
fused rule in ``jax.custom_vjp``): it is compared with the anchor's run of
the same program without ``fwd_bwd`` (row ``grad(checkpoint(F))``).

Run:  python benchmarks/counts.py [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples"))
sys.path.insert(1, HERE)
sys.path.insert(2, os.path.join(HERE, os.pardir))
import _report as R  # noqa: E402
import seed_remat as S  # noqa: E402

from smartvjp import smart_custom_vjp  # noqa: E402

REMAT3_SMART = "smartvjp (remat3 flags)"
# jax.custom_vjp with defvjp plus defremat(f-forward, fwd-in-rem, bwd), the
# schedule JAX 0.12 lets a user write by hand (needs both flags)
DEFREMAT = "defvjp+defremat (flags)"
IMPLS = ["jax.custom_vjp", "optimize_remat", "vjp3+remat3", DEFREMAT,
         "smartvjp", REMAT3_SMART]
# the columns that run with jax_custom_vjp3 + jax_remat3 on
WITH_FLAGS = ("vjp3+remat3", DEFREMAT, REMAT3_SMART)
X = jnp.linspace(-1.0, 2.0, 8, dtype=jnp.float32)


EXPERIMENTAL = ("jax_custom_vjp3", "jax_remat3")


def has_experimental_flags() -> bool:
  return all(hasattr(jax.config, n) for n in EXPERIMENTAL)


@contextlib.contextmanager
def flags(impl):
  if not has_experimental_flags():   # this JAX lacks them: leave config alone
    yield
    return
  old = {n: getattr(jax.config, n) for n in EXPERIMENTAL}
  for n in EXPERIMENTAL:
    jax.config.update(n, impl in WITH_FLAGS)
  try:
    yield
  finally:
    for n, v in old.items():
      jax.config.update(n, v)


def make(impl, f, fwd, bwd, fwd_bwd=None, symbolic_zeros=False):
  if impl in ("smartvjp", REMAT3_SMART):
    F = smart_custom_vjp(f)
    F.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros, fwd_bwd=fwd_bwd)
    return F
  if fwd_bwd is not None:
    return None  # no fused rule in jax.custom_vjp
  if impl == DEFREMAT:
    if symbolic_zeros or not hasattr(jax.custom_vjp, "defremat"):
      return None   # defremat is new in jax 0.12
    F = jax.custom_vjp(f)
    F.defvjp(fwd, bwd)
    F.defremat(lambda *a: (f(*a), None), lambda _, *a: fwd(*a), bwd)
    return F
  F = jax.custom_vjp(f)
  F.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros,
           optimize_remat=impl == "optimize_remat")
  return F


# -- rule sets ----------------------------------------------------------------

def kernels(kind="computed"):
  fwd, bwd = S.seed_rules() if kind == "seed" else S.computed_rules(
      "res" if kind == "named" else None)
  return dict(f=S.f_kernel, fwd=fwd, bwd=bwd)


def jax_rules():
  return dict(f=jnp.sin, fwd=lambda x: (jnp.sin(x), jnp.cos(x)),
              bwd=lambda c, g: (c * g,))


def symbolic_rules():
  def fwd(x):
    return jnp.sin(x.value), jnp.cos(x.value)

  def bwd(c, g):
    return (jnp.zeros_like(c) if type(g) is SymbolicZero else c * g,)
  return dict(f=jnp.sin, fwd=fwd, bwd=bwd, symbolic_zeros=True)


def debug_fwd_rules():
  k = kernels()
  inner = k["fwd"]

  def fwd(x):
    # the effect of a jax.debug.print, printing nothing: the table's rows
    # stay the only output after the header
    jax.debug.callback(lambda: None, ordered=False)
    return inner(x)
  return dict(k, fwd=fwd)


def remat_loss(F, policy=None):
  return lambda x: jnp.sum(jax.checkpoint(F, policy=policy)(x) ** 2)


def scan_loss(F, n=4):
  body = lambda c, _: (jax.checkpoint(F)(c), None)
  return lambda x: jnp.sum(jax.lax.scan(body, x, None, length=n)[0] ** 2)


def while_fn(F):
  return lambda x: jax.lax.while_loop(lambda c: c[1] < 2,
                                      lambda c: (F(c[0]), c[1] + 1), (x, 0))[0]


# (row, rules, extra defvjp kwargs, program(F), counted?)
ROWS = [
    ("F(x) under jit", kernels, {}, lambda F: jax.jit(F), True),
    ("grad, no remat", kernels, {},
     lambda F: jax.jit(jax.grad(lambda x: jnp.sum(F(x) ** 2))), True),
    ("grad(checkpoint(F))", kernels, {},
     lambda F: jax.jit(jax.grad(remat_loss(F))), True),
    ("the same, eager", kernels, {}, lambda F: jax.grad(remat_loss(F)), True),
    ("seed's fwd (residual = x), checkpoint", lambda: kernels("seed"), {},
     lambda F: jax.jit(jax.grad(remat_loss(F))), True),
    ("scan of 4 checkpointed layers", kernels, {},
     lambda F: jax.jit(jax.grad(scan_loss(F))), True),
    ("checkpoint(F∘F)", kernels, {},
     lambda F: jax.jit(jax.grad(lambda x: jnp.sum(
         jax.checkpoint(lambda x: F(F(x)))(x) ** 2))), True),
    ("checkpoint, everything_saveable", kernels, {},
     lambda F: jax.jit(jax.grad(remat_loss(
         F, jax.checkpoint_policies.everything_saveable))), True),
    ("named residual, save_only_these_names", lambda: kernels("named"), {},
     lambda F: jax.jit(jax.grad(remat_loss(
         F, jax.checkpoint_policies.save_only_these_names("res")))), True),
    ("checkpoint, fwd_bwd also given", kernels,
     {"fwd_bwd": S.fwd_bwd_kernel},
     lambda F: jax.jit(jax.grad(remat_loss(F))), True),
    ("debug print in fwd, checkpoint", debug_fwd_rules, {},
     lambda F: jax.jit(jax.grad(remat_loss(F))), True),
    ("vmap(grad(checkpoint(F))), batch of 8", kernels, {},
     lambda F: jax.jit(jax.vmap(jax.grad(remat_loss(F)))), True),
    ("cond, call in taken branch, checkpoint", kernels, {},
     lambda F: jax.jit(jax.grad(lambda x: jnp.sum(jax.lax.cond(
         True, jax.checkpoint(F), lambda x: x, x) ** 2))), True),
    ("grad(grad) of checkpoint(F)", jax_rules, {},
     lambda F: jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(remat_loss(F))(x)))),
     False),
    ("jax.hessian of checkpoint(F)", jax_rules, {},
     lambda F: jax.jit(jax.hessian(remat_loss(F))), False),
    ("symbolic_zeros=True, checkpoint", symbolic_rules, {},
     lambda F: jax.jit(jax.grad(remat_loss(F))), False),
    ("jax.jvp (forward mode)", jax_rules, {},
     lambda F: jax.jit(lambda x: jax.jvp(F, (x,), (jnp.ones_like(x),))[1]),
     False),
    ("jax.jacfwd", jax_rules, {}, lambda F: jax.jit(jax.jacfwd(F)), False),
    ("jvp through while_loop", jax_rules, {},
     lambda F: jax.jit(lambda x: jax.jvp(while_fn(F), (x,),
                                         (jnp.ones_like(x),))[1]), False),
]


def reference(program, rules, kw):
  r = rules()
  plain = r["f"] if r["f"] is not S.f_kernel else jnp.sin
  return program(plain)


def measure():
  """``{row: {impl: (counts | None, ok: bool, error | None)}}``."""
  table = {}
  for row, rules, kw, program, counted in ROWS:
    table[row] = {}
    for impl in IMPLS:
      if impl in WITH_FLAGS and not has_experimental_flags():
        table[row][impl] = (None, False, "flags not in this JAX")
        continue
      r = rules()
      S.LAUNCHES.clear()
      try:
        with flags(impl):
          F = make(impl, r.pop("f"), r.pop("fwd"), r.pop("bwd"), **r, **kw)
          if F is None:
            table[row][impl] = (None, False, "not in API")
            continue
          out = jax.block_until_ready(program(F)(X))
          jax.effects_barrier()
        want = reference(program, rules, kw)(X)
        ok = bool(np.allclose(out, want, rtol=1e-5, atol=1e-6))
        table[row][impl] = (dict(S.LAUNCHES) if counted else None, ok, None)
      except Exception as e:  # noqa: BLE001 - reported in the table
        table[row][impl] = (None, False, type(e).__name__)
  return table


def cell(entry):
  counts, ok, err = entry
  if err:
    if err == "flags not in this JAX":
      return "n/a (no such flags)"
    return "—" if err == "not in API" else f"error ({err})"
  text = S.fmt_counts(counts) if counts is not None else "works"
  return text if ok else f"{text}, WRONG VALUE"


# (smartvjp column, its anchor): the goal of the module docstring
PAIRS = (("smartvjp", "jax.custom_vjp"), (REMAT3_SMART, "vjp3+remat3"))
# rows whose anchor has no such API, and the row that runs the same program
# without it
FALLBACK = {"checkpoint, fwd_bwd also given": "grad(checkpoint(F))"}


def no_more(mine, anchor):
  """The goal for one cell: True (met), False (not met), None (n/a: this
  JAX lacks the column's flags)."""
  if mine[2] == "flags not in this JAX" or anchor[2] == "flags not in this JAX":
    return None
  a_counts, a_ok, a_err = anchor
  if a_err or not a_ok:
    return True            # the anchor fails here: nothing to be worse than
  counts, ok, err = mine
  if err or not ok:
    return False
  if a_counts is None:     # a row that checks values only
    return True
  total = lambda c: sum(c.values())
  return (total(counts) <= total(a_counts)
          and all(counts.get(r, 0) <= a_counts.get(r, 0) for r in ("fwd", "bwd")))


def row_goals(table):
  """``{row: {smart column: True | False | None}}``."""
  out = {}
  for row, cells in table.items():
    anchors = table[FALLBACK[row]] if row in FALLBACK else cells
    out[row] = {smart: no_more(cells[smart], anchors[anchor])
                for smart, anchor in PAIRS}
  return out


def _goal_cell(results):
  known = [v for v in results.values() if v is not None]
  return "n/a" if not known else R.verdict(all(known))


def check_goals(table, goals):
  """One goal per pair of columns, over every row, into ``goals``."""
  per_row = row_goals(table)
  for smart, anchor in PAIRS:
    verdicts = {row: v[smart] for row, v in per_row.items()}
    if all(v is None for v in verdicts.values()):
      continue             # no such flags in this JAX
    bad = [row for row, v in verdicts.items() if v is False]
    goals.check(f"{smart} <= {anchor} in every row ({len(verdicts)} rows"
                + (f"; not in: {', '.join(bad)}" if bad else "") + ")",
                not bad)


def render(table, markdown=False):
  goals = row_goals(table)
  lines = []
  if markdown:
    lines.append("| program | " + " | ".join(f"`{i}`" for i in IMPLS)
                 + " | goal (smartvjp <= its anchor) |")
    lines.append("|---" * (len(IMPLS) + 2) + "|")
    for row, cells in table.items():
      lines.append(f"| {row} | " + " | ".join(cell(cells[i]) for i in IMPLS)
                   + f" | {_goal_cell(goals[row])} |")
  else:
    w = max(map(len, table))
    lines.append(f"{'program':<{w}} | " + " | ".join(f"{i:<24}" for i in IMPLS)
                 + " | goal")
    lines.append("-" * (w + 27 * len(IMPLS) + 7))
    for row, cells in table.items():
      lines.append(f"{row:<{w}} | " + " | ".join(f"{cell(cells[i]):<24}"
                                                  for i in IMPLS)
                   + f" | {_goal_cell(goals[row])}")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--markdown", action="store_true")
  args = parser.parse_args(argv)
  t0 = time.perf_counter()
  table = measure()
  print(R.header())
  print("counts are kernel launches per gradient step (Pallas interpret-mode "
        "kernels); deterministic: one run, no spread.")
  print("goal column: smartvjp <= jax.custom_vjp and smartvjp (remat3 flags) "
        "<= vjp3+remat3 (right value, no more launches\nin all, no more fwd "
        "or bwd launches; met where the anchor fails).")
  print("\"seed's fwd\": the fwd of the seed program (jax-ml/jax#21303, the "
        "report this project answers), whose residual\nis its input x; the "
        "other rows' fwd computes its residual (cos x).\n")
  print(render(table, args.markdown))
  goals = R.Goals()
  check_goals(table, goals)
  print()
  print(goals.render())
  print(f"\nFinished in {time.perf_counter() - t0:.1f} s.")
  return table


if __name__ == "__main__":
  main()
