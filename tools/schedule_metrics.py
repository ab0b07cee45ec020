"""The size and shape figures of issue 47, measured on the working tree.

  python tools/schedule_metrics.py          # print them
  python tools/schedule_metrics.py --json   # the same as JSON

* lines: the core (every module of ``smartvjp/`` but ``_swap``,
  ``tesseract`` and ``_equinox``), each of those three, and the audit
  (every module of ``smartvjp/audit/``), in all and as code (no blank
  line, comment or docstring);
* ``_facade.py``: lines, top-level functions and aliases (top-level names
  bound to another name or an attribute: ``Var = core.Var``);
* the walk of ``jit(grad(sum(checkpoint(F)(x)**2)))`` traced with
  ``sys.setprofile``, for design/walkthrough.py's ``F`` and for the seed's
  (its ``fwd``'s residual is its input): see :func:`walk`.

Issue 47's targets: ``_facade.py`` at most 600 lines, ``_policy.facts`` once per differentiated call, at most 90 module
switches in the walk of design/walkthrough.py's ``F`` counted outside
``_facade`` (the count the issue's 130 at f7b3041 compares with: this tool
gives 127 at f6fea98 on jax 0.12.0.1, 247 counting ``_facade``'s frames).
The core's size has no fixed target (issue 47's 5,700 lines was retired by
issue 55): ``tests/test_schedule_metrics.py`` fails once the core or the
walk's switches outside ``_facade`` grow past the numbers written there.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import sys
import tokenize

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
PKG = os.path.normpath(os.path.join(ROOT, "smartvjp"))
APART = ("_swap", "tesseract", "_equinox")


def _code_lines(path) -> int:
  """Lines holding code: not blank, not only a comment, not in a docstring."""
  with open(path, encoding="utf-8") as fh:
    src = fh.read()
  doc_lines = set()
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                         ast.ClassDef)):
      body = node.body
      if (body and isinstance(body[0], ast.Expr)
          and isinstance(body[0].value, ast.Constant)
          and isinstance(body[0].value.value, str)):
        doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
  code = set()
  for tok in tokenize.generate_tokens(io.StringIO(src).readline):
    if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                    tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
      continue
    code.update(range(tok.start[0], tok.end[0] + 1))
  return len(code - doc_lines)


def lines() -> dict:
  out = {"core": {"lines": 0, "code": 0}, "audit": {"lines": 0, "code": 0}}
  audit = os.path.join(PKG, "audit")
  for folder in (PKG, audit):
    for name in sorted(os.listdir(folder)):
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      with open(path, encoding="utf-8") as fh:
        n = sum(1 for _ in fh)
      entry = {"lines": n, "code": _code_lines(path)}
      mod = "audit" if folder == audit else name[:-3]
      if mod in APART:
        out[mod] = entry
      else:
        group = out["audit" if folder == audit else "core"]
        group["lines"] += entry["lines"]
        group["code"] += entry["code"]
  return out


def facade() -> dict:
  path = os.path.join(PKG, "_facade.py")
  with open(path, encoding="utf-8") as fh:
    src = fh.read()
  tree = ast.parse(src)
  functions = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in tree.body)
  aliases = 0
  for n in tree.body:
    if isinstance(n, ast.Assign) and isinstance(n.value,
                                                (ast.Name, ast.Attribute)):
      aliases += sum(isinstance(t, ast.Name) for t in n.targets)
  return {"lines": src.count("\n"), "functions": functions,
          "aliases": aliases}


def _make_F(seed: bool):
  """``F = sin`` with ``fwd`` keeping ``cos x`` (design/walkthrough.py's) or,
  ``seed``, keeping ``x`` itself (the seed's: its residual is its input)."""
  import jax.numpy as jnp
  from smartvjp import smart_custom_vjp

  @smart_custom_vjp
  def F(x):
    return jnp.sin(x)

  if seed:
    F.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g,))
  else:
    F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  return F


def walk(seed: bool) -> dict:
  """Traces ``jit(grad(sum(checkpoint(F)(x)**2)))`` once (a fresh ``F``, so
  nothing is cached) and counts the smartvjp frames the profiler sees enter,
  in order: all, those in ``_facade``, the ``_policy.facts`` calls, and the
  module switches (two frames entered one after the other in different
  modules), counted over all frames and over those outside ``_facade``."""
  import jax
  import jax.numpy as jnp
  from smartvjp import _policy

  F = _make_F(seed)
  x = jnp.ones(3, jnp.float32)
  loss = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x) ** 2)))
  facts_code = _policy.facts.__code__
  prefix = PKG + os.sep
  seq = []

  def profile(frame, event, arg):
    del arg
    code = frame.f_code
    if event == "call" and code.co_filename.startswith(prefix):
      seq.append((os.path.basename(code.co_filename)[:-3],
                  code is facts_code))

  sys.setprofile(profile)
  try:
    loss.lower(x)
  finally:
    sys.setprofile(None)
  mods = [m for m, _ in seq]
  outside = [m for m in mods if m != "_facade"]
  switches = lambda ms: sum(a != b for a, b in zip(ms, ms[1:]))
  return {"frames": len(seq), "facade_frames": len(mods) - len(outside),
          "facts_calls": sum(f for _, f in seq),
          "module_switches": switches(mods),
          "module_switches_outside_facade": switches(outside)}


def measure() -> dict:
  import jax
  return {"jax": jax.__version__, "lines": lines(), "facade": facade(),
          "walk": {"walkthrough F": walk(False), "seed F": walk(True)}}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  m = measure()
  if args.json:
    print(json.dumps(m, indent=1))
    return 0
  print(f"jax {m['jax']}")
  for name, e in m["lines"].items():
    print(f"lines {name:10s} {e['lines']:6d} ({e['code']} code)")
  f = m["facade"]
  print(f"_facade.py      {f['lines']:6d} lines, {f['functions']} functions, "
        f"{f['aliases']} aliases")
  for name, w in m["walk"].items():
    print(f"walk, {name}: {w['frames']} smartvjp frames "
          f"({w['facade_frames']} in _facade), {w['facts_calls']} "
          f"_policy.facts calls, {w['module_switches']} module switches "
          f"({w['module_switches_outside_facade']} outside _facade)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
