"""No dead code in the package: vulture (the ``test`` extra) finds nothing
beyond the names ``tools/vulture_whitelist.py`` lists, each with the reason
vulture cannot see its use."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


def vulture(*paths):
  pytest.importorskip("vulture")
  return subprocess.run(
      [sys.executable, "-m", "vulture", *paths, "--min-confidence", "60"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_no_unused_code_in_the_package():
  out = vulture("smartvjp", "tools/vulture_whitelist.py")
  assert out.returncode == 0, out.stdout + out.stderr


def test_the_whitelist_is_needed_entry_by_entry():
  # without the whitelist, every listed name is reported: none is stale
  out = vulture("smartvjp")
  reported = {line.split("'")[1] for line in out.stdout.splitlines() if "'" in line}
  tree = ast.parse(open(os.path.join(ROOT, "tools", "vulture_whitelist.py")).read())
  listed = {ast.unparse(node.value).split(".")[-1] for node in tree.body[1:]
            if isinstance(node, ast.Expr)}
  assert listed and listed <= reported, sorted(listed - reported)
