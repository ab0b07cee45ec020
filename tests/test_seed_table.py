"""The README's table of what ``examples/seed_remat.py`` prints (issue 65):
the columns it gives for the installed JAX equal what the demo prints here,
and ``tools/seed_table.py`` splits a column by JAX version only where the
versions differ."""

import os
import sys

import jax
import pytest

from test_examples import load_from

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
tool = load_from("tools", "seed_table")


def test_the_readme_table_is_what_the_demo_prints_on_this_jax():
  version, rows = tool.parse_demo(tool.run_demo(sys.executable))
  assert version == jax.__version__
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  columns = tool.columns_for(tool.readme_table(text), version)
  if columns is None:
    pytest.skip(f"the README gives no column for jax {version}: pip installs "
                f"{sorted(tool.PYTHONS)} from the README's commands")
  for impl, cells in columns.items():
    assert cells == {p: rows[p][impl] for p in rows}, (impl, version)


def _run(version, jax_cell):
  return version, {"a": {"jax.custom_vjp": jax_cell, "optimize_remat": "—",
                         "smartvjp": "f 1"},
                   "b": {"jax.custom_vjp": "fwd 2", "optimize_remat": "f 1",
                         "smartvjp": "f 1, fwd 1"}}


def test_a_column_is_split_by_version_only_where_the_versions_differ():
  old, new = _run("0.10.2", "fwd 2"), _run("0.12.1", "fwd 1")
  table = tool.readme_table(
      f"{tool.BEGIN}\n{tool.render([old, new])}\n{tool.END}")
  assert list(table) == [
      "`jax.custom_vjp`, jax 0.10.2 (Python 3.11)",
      "`jax.custom_vjp`, jax 0.12.1 (Python 3.12, 3.13)",
      "`optimize_remat=True`", "`smart_custom_vjp`"]
  for version, rows in (old, new):
    columns = tool.columns_for(table, version)
    assert columns == {i: {p: rows[p][i] for p in rows} for i in tool.IMPLS}
  assert tool.columns_for(table, "0.11.2") is None
  # the same cells on both versions: one column, which holds for either
  same = tool.readme_table(
      f"{tool.BEGIN}\n{tool.render([old, _run('0.12.1', 'fwd 2')])}\n{tool.END}")
  assert list(same) == [tool.IMPLS[i] for i in tool.IMPLS]
  assert tool.columns_for(same, "0.11.2") == tool.columns_for(same, "0.10.2")


def test_the_demo_printout_is_parsed():
  out = ("Kernel launches per gradient step (jax 0.12.1, cpu), counted\n\n"
         "program  | jax.custom_vjp | optimize_remat | smartvjp\n" + "-" * 40
         + "\nx, y     | fwd 1, bwd 1   | — (not in API) | f 1, fwd_bwd 1\n\n"
         "Gradients compared\n")
  assert tool.parse_demo(out) == ("0.12.1", {"x, y": {
      "jax.custom_vjp": "fwd 1, bwd 1", "optimize_remat": "—",
      "smartvjp": "f 1, fwd_bwd 1"}})
