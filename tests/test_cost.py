"""Never more work than jax.custom_vjp (or optimize_remat), under every remat
policy and every kind of rule: XLA's flops and temporary memory, and kernel
launches counted at run time (a small version of benchmarks/cost.py)."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks",
                     "cost.py")
_spec = importlib.util.spec_from_file_location("smartvjp_cost_bench", _PATH)
cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cost)

SIZES = dict(batch=16, width=32, layers=2, scan=True,
             compiler_options=cost.FAST_COMPILE)
# XLA's flop count of the same arithmetic varies by a unit or two with the
# shapes of the (zero-flop) custom calls around it; any real operation of
# these programs costs at least an array of batch * width elements
SLACK = 16


@pytest.fixture(scope="module")
def results():
  return cost.table(**SIZES)


@pytest.mark.parametrize("policy", list(cost.POLICIES))
def test_smartvjp_never_does_more_than_the_anchors(results, policy):
  for kind in cost.KINDS:
    row = results[(policy, kind)]
    if row["jax.custom_vjp"] is None:   # offloading unsupported here
      continue
    base, opt = row["jax.custom_vjp"], row["optimize_remat"]
    for impl in ("smartvjp", "smartvjp+fwd_bwd"):
      c, where = row[impl], f"{impl}, {policy}, {kind} rules"
      assert c["flops"] <= base["flops"] + SLACK, (where, c, base)
      assert c["flops"] <= opt["flops"] + SLACK, (where, c, opt)
      assert c["launches"] <= base["launches"], (where, c, base)
      assert c["launches"] <= opt["launches"], (where, c, opt)
      assert c["temp"] <= 1.05 * base["temp"], (where, c, base)


def test_the_mixed_residual_case_saves_the_matmul():
  # the issue's case: fwd returns (x, w, y, gelu'(y)); under dots_saveable
  # jax.custom_vjp saves y and recomputes gelu'(y) only; so does smartvjp,
  # where recomputing the whole call would add a matmul per layer
  sizes = dict(batch=64, width=64, layers=3, scan=True,
               compiler_options=cost.FAST_COMPILE)
  row = {i: cost.measure(i, "mixed", "dots_saveable", **sizes)
         for i in ("jax.custom_vjp", "optimize_remat", "smartvjp")}
  matmul = 2 * 64 * 64 * 64
  assert row["smartvjp"]["flops"] <= row["jax.custom_vjp"]["flops"]
  assert row["optimize_remat"]["flops"] - row["smartvjp"]["flops"] >= matmul - SLACK


def test_the_printed_goals_are_met_and_the_kernel_flops_say_na(results):
  # benchmarks/cost.py prints these verdicts; the same cells must meet them
  goals = cost.R.Goals()
  cost.check_goals(results, goals)
  assert len(goals.items) == 7 and goals.all_met, goals.render()
  text = cost.render(results)
  rows = text.split("\n")[5:]   # after the three legend lines and the head
  kernel_rows = [l for l in rows if l[41:50].strip() == "kernel"]
  assert len(kernel_rows) == len(cost.POLICIES)
  for line in kernel_rows:   # host-callback kernels: XLA counts no flops
    assert line.count("n/a/") == len(cost.IMPLS) and "(1.00)" not in line
  assert not any("*" in l for l in rows)   # no cell marked as missing a goal
  # a cell above its anchor is marked and fails its goal
  row = {i: dict(results[("dots_saveable", "kernel")][i]) for i in cost.IMPLS}
  row["smartvjp"]["launches"] = row["jax.custom_vjp"]["launches"] + 1
  assert cost.cell_failures(row)["smartvjp"] == [
      "launches > jax.custom_vjp", "launches > optimize_remat"]
  bad = cost.R.Goals()
  cost.check_goals({("dots_saveable", "kernel"): row}, bad)
  assert not bad.all_met
