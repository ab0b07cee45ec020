"""``design/architecture.md``'s rule table is the registered rules.

The table lists, for every smartvjp primitive, each rule registered with JAX
(``_primitive.define``, called at the bottom of each primitive's module) and
the file and function that implements it. This test fails when a listed function does
not exist, when a registered rule is missing from the table, or when the
table names a rule or function that is not the registered one.
"""

from __future__ import annotations

import importlib
import pathlib
import re

from smartvjp._primitive import RULES

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "design" / "architecture.md"
ROW = re.compile(r"^\| `(smartvjp_\w+)` \| (\w+) \| `(smartvjp/\w+\.py):(\w+)` \|$")


def _where(fn) -> tuple[str, str]:
  """(file, function) of a registered rule; a rule built by a factory is
  named by the factory."""
  module = fn.__module__.replace(".", "/") + ".py"
  return module, fn.__qualname__.split(".<locals>")[0]


def registered_rows() -> set[tuple[str, str, str, str]]:
  return {(prim, kind, *_where(fn))
          for prim, rules in RULES.items()
          for kind, fn in rules.items()}


def table_rows() -> list[tuple[str, str, str, str]]:
  text = DOC.read_text()
  block = text.split("<!-- rules:begin -->")[1].split("<!-- rules:end -->")[0]
  rows = []
  for line in block.splitlines():
    m = ROW.match(line.strip())
    if m:
      rows.append(m.groups())
  return rows


def expected_table() -> str:
  lines = ["| primitive | rule | file:function |", "|---|---|---|"]
  for prim, kind, path, fn in sorted(registered_rows()):
    lines.append(f"| `{prim}` | {kind} | `{path}:{fn}` |")
  return "\n".join(lines)


def test_every_listed_function_exists():
  rows = table_rows()
  assert len(rows) > 50
  for prim, kind, path, fn in rows:
    assert (ROOT / path).is_file(), (prim, kind, path)
    module = importlib.import_module(path[:-3].replace("/", "."))
    assert callable(getattr(module, fn, None)), f"{path}:{fn} ({prim} {kind})"


def test_table_is_the_registered_rules():
  rows = table_rows()
  assert len(rows) == len(set(rows)), "a row is listed twice"
  missing = registered_rows() - set(rows)
  extra = set(rows) - registered_rows()
  assert not missing and not extra, (
      f"registered but not in design/architecture.md: {sorted(missing)}\n"
      f"in the table but not registered: {sorted(extra)}\n"
      f"the table should read:\n{expected_table()}")


def test_every_primitive_has_core_rules():
  for prim, rules in RULES.items():
    # discharge: any of them may meet a reference (an argument, a residual,
    # or one that a rule creates), and jit discharges every equation then
    for kind in ("impl", "abstract_eval", "lowering", "jvp", "dce", "batching",
                 "discharge"):
      assert kind in rules, (prim, kind)


if __name__ == "__main__":
  # python tests/test_architecture.py: rewrite the table from the registry
  text = DOC.read_text()
  head, rest = text.split("<!-- rules:begin -->\n")
  _, tail = rest.split("<!-- rules:end -->")
  DOC.write_text(f"{head}<!-- rules:begin -->\n{expected_table()}\n"
                 f"<!-- rules:end -->{tail}")


def test_module_map_lists_every_module():
  text = DOC.read_text()
  block = text.split("## Module map")[1].split("\n## ")[0]
  listed = set(re.findall(r"^\| `(\w+\.py)` \|", block, re.M))
  present = {p.name for p in (ROOT / "smartvjp").glob("*.py")}
  assert listed == present, (f"not in the module map: {present - listed}; "
                             f"listed but absent: {listed - present}")


def test_each_primitive_is_defined_in_its_own_module():
  """Every rule of a primitive lives in one module, or in a helper module
  the rules share (``_primitive``, a factory there)."""
  shared = {"smartvjp/_primitive.py"}
  for prim, rules in RULES.items():
    homes = {_where(fn)[0] for fn in rules.values()} - shared
    assert len(homes) == 1, (prim, sorted(homes))
