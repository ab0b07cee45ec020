"""``tools/schedule_metrics.py``: the figures issue 47 is held to."""

import importlib.util
import json
import os
import re

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "tools",
                     "schedule_metrics.py")


@pytest.fixture(scope="module")
def metrics():
  spec = importlib.util.spec_from_file_location("schedule_metrics", _PATH)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_lines_add_up(metrics):
  total = 0
  pkg = metrics.PKG
  for name in os.listdir(pkg):
    if name.endswith(".py"):
      with open(os.path.join(pkg, name), encoding="utf-8") as fh:
        total += sum(1 for _ in fh)
  got = metrics.lines()
  assert sum(e["lines"] for e in got.values()) == total
  assert set(got) == {"core", *metrics.APART}
  assert all(0 < e["code"] < e["lines"] for e in got.values())


@pytest.mark.parametrize("seed", [False, True])
def test_walk_counts_what_it_traces(metrics, seed):
  w = metrics.walk(seed=seed)
  assert 0 < w["facade_frames"] < w["frames"]
  assert w["module_switches_outside_facade"] <= w["module_switches"] < w["frames"]


@pytest.mark.parametrize("seed", [False, True])
def test_facts_are_computed_once_per_differentiated_call(metrics, seed):
  """Issue 47: the facts of the call are gathered once, kept on its traced
  ``fwd``, and read by every later rule."""
  assert metrics.walk(seed=seed)["facts_calls"] == 1


def test_prints_json(metrics, capsys):
  assert metrics.main(["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["facade"]["functions"] > 0


def test_the_core_grows_only_with_a_changelog_note(metrics):
  """The core may grow ``GROWTH_BUDGET`` lines past the latest size
  CHANGELOG.md notes ("Core size note: N lines", the first one in the file);
  beyond, a change notes the new size there, with its reason."""
  path = os.path.join(metrics.ROOT, "CHANGELOG.md")
  with open(path, encoding="utf-8") as fh:
    noted = re.findall(r"Core size note[^:]*: ([\d,]+) lines", fh.read())
  assert noted, "CHANGELOG.md has no 'Core size note: N lines'"
  size = metrics.lines()["core"]["lines"]
  limit = int(noted[0].replace(",", "")) + metrics.GROWTH_BUDGET
  assert size <= limit, (
      f"the core is {size} lines, more than {metrics.GROWTH_BUDGET} past the "
      f"{noted[0]} CHANGELOG.md notes: note the new size there, and why")
