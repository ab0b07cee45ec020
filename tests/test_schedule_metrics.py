"""``tools/schedule_metrics.py``: the figures issue 47 is held to."""

import importlib.util
import json
import os

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


def test_walk_counts_what_it_traces(metrics):
  w = metrics.walk(seed=False)
  assert w["facts_calls"] >= 1
  assert 0 < w["facade_frames"] < w["frames"]
  assert w["module_switches_outside_facade"] <= w["module_switches"] < w["frames"]


def test_prints_json(metrics, capsys):
  assert metrics.main(["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["facade"]["functions"] > 0
