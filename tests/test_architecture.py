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

import pytest

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
  # the command line (python -m smartvjp.audit), which nothing imports,
  # stands on the audit's public API
  audit = [m for m in graph if m != "audit.__main__"]
  assert max(depth(m) for m in audit) <= 9, {m: depth(m) for m in graph}
  assert depth("audit.__main__") == depth("audit.__init__") + 1


# -- the import graph of smartvjp/ ---------------------------------------------------

PKG = ROOT / "smartvjp"


def _is_module(dotted: str) -> bool:
  """``smartvjp._swap``, ``smartvjp.audit`` (a package): a module of ours."""
  path = ROOT.joinpath(*dotted.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _package_of(path: pathlib.Path) -> list[str]:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return parts if parts[-1] == "__init__" and parts.pop() else parts[:-1]


def imports(source: str, path: pathlib.Path) -> list[tuple[str, list, bool]]:
  """Every import in ``source`` (the file at ``path``), in any form, as
  ``(module, [(name, bound as)], in_function)``: ``import a.b as c`` is
  ``("a.b", [], ...)`` binding ``c`` (``("a.b", [(None, "c")], ...)``);
  ``from a.b import (x, y as z)`` is ``("a.b", [("x", "x"), ("y", "z")])``;
  a relative import's module is made absolute. Parsed with ``ast``, so
  docstrings' examples are strings, not imports; ``importlib.import_module``
  and ``__import__`` of a constant name count as ``import name``."""
  found = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inner = in_function or isinstance(
          child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        for a in child.names:
          found.append((a.name, [(None, a.asname or a.name.split(".")[0])],
                        in_function))
      elif isinstance(child, ast.ImportFrom):
        base = child.module or ""
        if child.level:
          up = _package_of(path)[:len(_package_of(path)) - child.level + 1]
          base = ".".join(up + ([base] if base else []))
        found.append((base, [(a.name, a.asname or a.name)
                             for a in child.names], in_function))
      elif (isinstance(child, ast.Call) and child.args
            and isinstance(child.args[0], ast.Constant)
            and isinstance(child.args[0].value, str)
            and ast.unparse(child.func) in ("importlib.import_module",
                                            "import_module", "__import__")):
        found.append((child.args[0].value, [], in_function))
      visit(child, inner)
  visit(ast.parse(source), False)
  return found


def _smartvjp_imports(path: pathlib.Path,
                      source: str | None = None) -> list[tuple[str, bool]]:
  """(imported smartvjp module, whether the import is inside a function),
  named as ``_graph`` names them (``_swap``, ``audit._count``,
  ``audit.__init__``), for each import of one in a file, in every form."""
  source = path.read_text() if source is None else source
  out = []
  for module, names, in_function in imports(source, path):
    if module != "smartvjp" and not module.startswith("smartvjp."):
      continue
    # from a package import its modules: those modules; anything else
    # (a name, or a plain import): the module itself
    subs = [f"{module}.{n}" for n, _ in names
            if n and _is_module(f"{module}.{n}")]
    targets = subs + ([module] if not names or len(subs) < len(names)
                      else [])
    for t in targets:
      short = t.split(".", 1)[1] if "." in t else "__init__"
      if (ROOT.joinpath(*t.split(".")) / "__init__.py").is_file():
        short = (short + ".__init__") if "." in t else short
      if short == "audit":
        short = "audit.__init__"
      out.append((short, in_function))
  return out


def _graph() -> dict[str, set[str]]:
  """The core's private modules and the audit's (``audit._count``)."""
  graph = {}
  for path in [*(ROOT / "smartvjp").glob("_*.py"),
               *(ROOT / "smartvjp" / "audit").glob("_*.py")]:
    name = ("audit." if path.parent.name == "audit" else "") + path.stem
    graph[name] = {m for m, _ in _smartvjp_imports(path)} - {name}
  # the package's __init__ exposes smartvjp.audit, which is built on the
  # core: the one import of the audit from below (test_core_below_audit)
  graph["__init__"].discard("audit.__init__")
  return graph


def _imports_audit(path: pathlib.Path, source: str | None = None) -> list:
  return [m for m, _ in _smartvjp_imports(path, source)
          if m.split(".")[0] == "audit"]


def test_core_below_audit():
  """No module of the core (nor ``_swap``, ``_equinox``, ``tesseract``,
  ``testing``) imports ``smartvjp.audit``, in any form, at any depth: the
  audit is built on the core and changes none of it. Only the package's
  ``__init__`` exposes it."""
  found = {p.name: _imports_audit(p) for p in sorted(PKG.glob("*.py"))
           if p.name != "__init__.py"}
  assert not any(found.values()), {k: v for k, v in found.items() if v}


AUDIT_IMPORTS = [
    "import smartvjp.audit", "import smartvjp.audit as A",
    "from smartvjp import audit", "from smartvjp import (_plan,\n audit)",
    "from smartvjp.audit import _count", "from smartvjp.audit._count import tag",
    "from .audit import _count", "from . import audit",
    "import importlib\nimportlib.import_module('smartvjp.audit._count')",
    "def f():\n  from smartvjp.audit import audit\n  return audit"]


@pytest.mark.parametrize("source", AUDIT_IMPORTS)
def test_core_below_audit_sees_every_form(source):
  assert _imports_audit(PKG / "_plan.py", source), source
  assert not _imports_audit(PKG / "_plan.py", "from smartvjp import _facade")


def private_reads(path: pathlib.Path, source: str | None = None) -> list:
  """``module._name`` for each private name of a smartvjp module that the
  file at ``path`` imports (``from smartvjp._swap import _why``, in
  parentheses too) or reads through a module it imports, in any form
  (``import smartvjp._swap as S`` then ``S._why``, ``smartvjp._swap._why``,
  ``from . import _swap``). A private module is a module, not a name."""
  source = path.read_text() if source is None else source
  bound, found = {}, []
  for module, names, _ in imports(source, path):
    if module != "smartvjp" and not module.startswith("smartvjp."):
      continue
    for name, local in names:
      if name is None:   # import a.b binds a; import a.b as c binds c
        bound[local] = (module.split(".")[0]
                        if local == module.split(".")[0] else module)
      elif _is_module(f"{module}.{name}"):
        bound[local] = f"{module}.{name}"
      elif name.startswith("_") and not name.startswith("__"):
        found.append(f"{module}.{name}")
  for node in ast.walk(ast.parse(source)):
    chain = []
    while isinstance(node, ast.Attribute):
      chain.insert(0, node.attr)
      node = node.value
    if not chain or not isinstance(node, ast.Name) or node.id not in bound:
      continue
    module = bound[node.id]
    for attr in chain:
      if _is_module(f"{module}.{attr}"):
        module = f"{module}.{attr}"
        continue
      if attr.startswith("_") and not attr.startswith("__"):
        found.append(f"{module}.{attr}")
      break
  return sorted(set(found))


def test_no_module_reads_another_modules_private_names():
  """``_swap.qualified``, not ``_swap._qualified``: a module imports and
  reads only the public names of the smartvjp modules it imports (the
  audit too), whatever the form of the import."""
  found = {str(p.relative_to(PKG)): private_reads(p)
           for p in sorted(PKG.rglob("*.py"))}
  assert not any(found.values()), {k: v for k, v in found.items() if v}


PRIVATE_READS = [
    "import smartvjp._swap as S\nS._why_jax",
    "from smartvjp._swap import (\n    qualified,\n    _why_jax)",
    "from smartvjp import _swap\n_swap._why_jax",
    "from smartvjp import (_plan,\n    _swap as S)\nS._why_jax(1)",
    "import smartvjp._swap\nsmartvjp._swap._why_jax",
    "from smartvjp._swap import _why_jax as w",
    "from ._swap import _why_jax", "from . import _swap as S\nS._why_jax",
    "from smartvjp.audit import _count as C\nC._tags",
    "import smartvjp.audit._count\nsmartvjp.audit._count._tags",
    "def f():\n  import smartvjp._swap as S\n  return S._why_jax"]


@pytest.mark.parametrize("source", PRIVATE_READS)
def test_private_reads_are_seen_in_every_form(source):
  assert private_reads(PKG / "_plan.py", source), source
  assert not private_reads(
      PKG / "_plan.py", "import smartvjp\nfrom smartvjp import _swap\n"
      "from smartvjp.audit import _count\n_swap.qualified, _count.tag, "
      "smartvjp.__name__, _swap.jx.batching._batch_inner")


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
