"""``design/architecture.md``'s rule table is the registered rules.

The table lists, for every smartvjp primitive, each rule registered with JAX
(``_primitive.define``, called at the bottom of each primitive's module) and
the file and function that implements it. This test fails when a listed function does
not exist, when a registered rule is missing from the table, or when the
table names a rule or function that is not the registered one.
"""

from __future__ import annotations

import ast
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


# Where each kind of rule lives: the module of its stage (a transformation),
# or _primitive.py where define() derives it from what the primitive
# evaluates.
STAGE_OF_KIND = {
    "jvp": "_ad", "linearization": "_ad", "transpose": "_ad",
    "transpose_with_logs": "_ad",
    "partial_eval": "_remat", "partial_eval_custom": "_remat",
    "dce": "_remat", "batching": "_batching", "remat3": "_remat",
    "checkify": "_checkify",
    "process": "_process",
}
DERIVED = "smartvjp/_primitive.py"


def test_each_rule_lives_in_the_module_of_its_stage():
  """Organized by stage, not by primitive: a primitive's specific rules are
  in the module of their transformation, its generic ones derived in
  ``_primitive``; a specific rule is named ``_<primitive>_<kind>`` (or
  after the rule it shares, such as forward-mode evaluation), so ``grep``
  finds it."""
  for prim, rules in RULES.items():
    short = prim.removeprefix("smartvjp_")
    for kind, fn in rules.items():
      path, name = _where(fn)
      if path == DERIVED:
        continue
      stage = STAGE_OF_KIND.get(kind)
      if stage is None:   # evaluation: forward mode of jvp and lin (_ad)
        assert path == "smartvjp/_ad.py", (prim, kind, path)
        continue
      assert path == f"smartvjp/{stage}.py", (prim, kind, path)
      assert name.startswith(f"_{short}_") or name.startswith("_"), name


def test_import_floors():
  """At most 7 floors from ``_versions`` up to ``__init__``, and the audit
  (built on the core) at most two more: a module's floor is one more than
  the highest floor it imports."""
  graph = _graph()
  floor: dict[str, int] = {}

  def depth(m):
    if m not in floor:
      floor[m] = 1 + max((depth(n) for n in graph.get(m, ())), default=0)
    return floor[m]
  core = [m for m in graph if not m.startswith("audit.")]
  assert max(depth(m) for m in core) <= 7, {m: depth(m) for m in graph}
  assert max(depth(m) for m in graph) <= 9, {m: depth(m) for m in graph}


# -- the import graph of smartvjp/ ---------------------------------------------------

def _smartvjp_imports(path: pathlib.Path) -> list[tuple[str, bool]]:
  """(imported smartvjp module, whether the import is inside a function) for
  each ``from smartvjp import _m`` / ``from smartvjp._m import ...`` in a
  file (docstrings' examples are strings, not imports, and are not seen)."""
  tree = ast.parse(path.read_text())
  found = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inner = in_function or isinstance(
          child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.ImportFrom) and child.module:
        if child.module == "smartvjp.audit":   # its private modules
          found.extend(("audit." + a.name, in_function) for a in child.names
                       if a.name.startswith("_"))
        elif child.module == "smartvjp":
          found.extend((a.name, in_function) for a in child.names
                       if a.name.startswith("_"))
        elif child.module.startswith("smartvjp."):
          found.append((child.module.split(".")[1], in_function))
      visit(child, inner)
  visit(tree, False)
  return found


def _graph() -> dict[str, set[str]]:
  """The core's private modules and the audit's (``audit._count``)."""
  graph = {}
  for path in [*(ROOT / "smartvjp").glob("_*.py"),
               *(ROOT / "smartvjp" / "audit").glob("_*.py")]:
    name = ("audit." if path.parent.name == "audit" else "") + path.stem
    graph[name] = {m for m, _ in _smartvjp_imports(path)} - {name}
  return graph


def test_no_function_local_import_of_a_smartvjp_module():
  """Every module imports the modules it uses at its top, so the import
  graph below is the whole graph (no function-local import closing a
  cycle that the test cannot see)."""
  local = sorted((p.name, m) for p in (ROOT / "smartvjp").rglob("*.py")
                 for m, inner in _smartvjp_imports(p) if inner)
  assert not local, local


def test_import_graph_has_no_cycle():
  graph = _graph()
  state: dict[str, int] = {}   # 1: on the current path, 2: done

  def visit(m, path):
    state[m] = 1
    for n in sorted(graph.get(m, ())):
      if state.get(n) == 1:
        raise AssertionError("import cycle: " + " -> ".join(path + [m, n]))
      if n not in state:
        visit(n, path + [m])
    state[m] = 2
  for m in sorted(graph):
    if m not in state:
      visit(m, [])


PROSE_NAME = re.compile(r"`(_[a-z]\w*)\.(\w+(?:\.\w+)*)")


def test_names_in_the_prose_exist():
  """Every ``_module.name`` the document names in a sentence (outside the
  generated table) is an attribute of that smartvjp module, so a rename or
  a deletion shows here."""
  text = DOC.read_text()
  text = text.split("<!-- rules:begin -->")[0] + \
      text.split("<!-- rules:end -->")[1]
  modules = {p.stem for p in (ROOT / "smartvjp").glob("_*.py")}
  checked, missing = 0, []
  for module, dotted in PROSE_NAME.findall(text):
    if module not in modules or dotted == "py":   # a file name
      continue
    obj = importlib.import_module(f"smartvjp.{module}")
    for part in dotted.split("."):
      obj = getattr(obj, part, None)
    checked += 1
    if obj is None:
      missing.append(f"{module}.{dotted}")
  assert checked > 20
  assert not missing, missing
