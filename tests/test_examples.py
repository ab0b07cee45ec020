"""The examples run and show what the README says they show."""

import concurrent.futures
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from smartvjp import _versions

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
EXAMPLE_TIMEOUT_S = 300   # 10-191 s each on 2 cores at a load average of 13-20


def load(name):
  return load_from("examples", name)


def load_from(folder, name):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(os.path.dirname(__file__), os.pardir, folder,
                         f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_seed_remat_table(capsys):
  seed = load("seed_remat")
  table = seed.main()
  out = capsys.readouterr().out
  assert "WRONG" not in out
  remat = "jit(grad(remat(F))), fwd computes its residual"
  assert table[remat, "jax.custom_vjp"][0] == {"fwd": 2, "bwd": 1}
  assert table[remat, "smartvjp"][0] == {"f": 1, "fwd": 1, "bwd": 1}
  literal = "jit(grad(remat(F))), seed's fwd (residual = x)"
  assert table[literal, "smartvjp"][0] == {"f": 1, "bwd": 1}
  named = "named residual, save_only_these_names"
  assert table[named, "optimize_remat"][0] == {"f": 1, "fwd": 1, "bwd": 1}
  assert table[named, "smartvjp"][0] == {"fwd": 1, "bwd": 1}
  fused = "remat(F) with fused fwd_bwd"
  assert table[fused, "smartvjp"][0] == {"f": 1, "fwd_bwd": 1}
  scan = "scan of 4 remat(F) layers"
  assert table[scan, "smartvjp"][0] == {"f": 4, "fwd": 4, "bwd": 4}
  # the closing rows: where smartvjp runs fewer kernels than optimize_remat
  wins, losses, ties = seed.against_optimize_remat(table)
  assert [w[0] for w in wins] == [named, fused] and not losses
  assert len(ties) == len(seed.CASES) - 2
  closing = out[out.index("Where smartvjp beats"):]
  assert named in closing and fused in closing and "What to conclude" in closing


def test_counts_benchmark_smartvjp_column():
  counts = load_from("benchmarks", "counts")
  table = counts.measure()
  smart = {row: cells["smartvjp"] for row, cells in table.items()}
  assert all(ok for _, ok, _ in smart.values()), smart
  assert smart["grad(checkpoint(F))"][0] == {"f": 1, "fwd": 1, "bwd": 1}
  assert smart["checkpoint, everything_saveable"][0] == {"fwd": 1, "bwd": 1}
  assert smart["debug print in fwd, checkpoint"][0] == {"f": 1, "fwd": 1,
                                                         "bwd": 1}
  assert table["grad(checkpoint(F))"]["jax.custom_vjp"][0] == {"fwd": 2,
                                                                "bwd": 1}
  assert table["jax.jvp (forward mode)"]["jax.custom_vjp"][2] == "TypeError"
  if counts.has_experimental_flags():   # remat3 rules: the same schedule
    for row, cells in table.items():
      assert cells[counts.REMAT3_SMART] == cells["smartvjp"], row
  # the printed goal: smartvjp <= jax.custom_vjp in every row
  goals = counts.R.Goals()
  counts.check_goals(table, goals)
  assert goals.items and goals.all_met, goals.render()
  assert counts.row_goals(table)["checkpoint, fwd_bwd also given"]["smartvjp"]
  assert "| met" in counts.render(table)
  # the goal itself: more launches, or a fwd more, or a wrong value, fail it
  ok = ({"fwd": 2, "bwd": 1}, True, None)
  assert counts.no_more(({"f": 1, "fwd": 1, "bwd": 1}, True, None), ok)
  assert not counts.no_more(({"f": 2, "fwd": 1, "bwd": 1}, True, None), ok)
  assert not counts.no_more(({"fwd": 3}, True, None), ok)
  assert not counts.no_more(({"f": 1}, False, None), ok)
  assert counts.no_more((None, False, "TypeError"), (None, False, "TypeError"))


def test_gpu_benchmark_smoke_runs_on_cpu(tmp_path, capsys):
  gpu = load_from("benchmarks", "accel_mlp")
  out = tmp_path / "smoke.json"
  gpu.main(["--smoke", "--out", str(out)])
  doc = json.loads(out.read_text())
  assert doc["schema"] == gpu.SCHEMA and doc["status"] == "complete"
  assert {"machine", "versions", "argv", "args", "started", "updated", "config",
          "results", "skipped", "errors", "device_memory_stats"} <= set(doc)
  assert {"device_kind", "platform", "device_count", "host",
          "cpu_count", "cpu_model"} <= set(doc["machine"])
  assert {"jax", "jaxlib", "python", "commit"} <= set(doc["versions"])
  # per hidden size and smartvjp row: memory, largest batch, step time and
  # the ideal step; against XLA both rows of the matmul and the fused
  # RMSNorm row: 10 + 9 goals
  assert len(doc["goals"]) == 19 * len(doc["config"]["hiddens"])
  assert all(set(g) == {"goal", "met"} for g in doc["goals"])
  # memory and largest batch are deterministic: they hold on any machine
  assert all(g["met"] for g in doc["goals"]
             if g["goal"].startswith(("memory", "largest")))
  # the ideal step of every kernel row, from its rules timed alone
  times = doc["rule_times"]
  assert set(times) == {f"{w}/{h}" for w in gpu.WORKLOADS
                        for h in doc["config"]["hiddens"]}
  for r in doc["results"]:
    rules = times[f"{r['workload']}/{r['hidden']}"]
    if r["impl"] == gpu.XLA:
      assert "ideal" not in r
      continue
    assert r["ideal"]["rules"] == list(gpu.IDEAL_RULES[r["impl"]])
    assert r["ideal"]["step_s"] == pytest.approx(
        doc["config"]["layers"] * sum(rules[k]["median_s"]
                                      for k in r["ideal"]["rules"]))
  assert doc["argv"] == ["--smoke", "--out", str(out)]
  assert not doc["skipped"] and not doc["errors"]
  cfg = doc["config"]
  assert {(r["workload"], r["hidden"], r["impl"]) for r in doc["results"]} == {
      (w, h, i) for w in gpu.WORKLOADS for h in cfg["hiddens"] for i in gpu.IMPLS}
  for r in doc["results"]:
    step, mem, big = r["step"], r["memory"], r["largest_batch"]
    assert step["status"] == mem["status"] == big["status"] == "ok", r
    assert 0 < step["min_s"] <= step["median_s"] <= step["max_s"]
    assert len(step["samples_s"]) == step["rounds"] == cfg["rounds"]
    assert r["throughput"]["value"] > 0
    assert r["throughput"]["unit"] == gpu.UNITS[r["workload"]]
    assert mem["total_bytes"] == (mem["temp_bytes"] + mem["argument_bytes"]
                                  + mem["output_bytes"]) > 0
    # the largest batch: a multiple of the granule that fits, the next one not
    probes = dict(big["probes"])
    assert big["batch"] > 0 and big["batch"] % cfg["granule"] == 0
    assert probes[big["batch"]] <= cfg["budget_bytes"]
    assert probes[big["batch"] + cfg["granule"]] > cfg["budget_bytes"]
    assert 1 <= big["compiles"] <= 6
    for section in (step, mem, big):
      assert section["ratio_to_custom_vjp"] > 0
      if r["impl"] == gpu.BASE:
        assert section["ratio_to_custom_vjp"] == 1.0
    assert r["grad_max_rel_diff"] < 0.05
  # the tables again from the file, with the README's markdown table
  capsys.readouterr()
  gpu.main(["--from-json", str(out), "--markdown"])
  printed = capsys.readouterr().out
  assert "| workload | hidden | implementation |" in printed
  assert "verdict: " in printed and "Goals (" in printed
  assert "machine: " in printed and "smartvjp at commit" in printed
  assert all(f"`{impl}`" in printed for impl in gpu.IMPLS)
  # past the deadline nothing starts, and the JSON says what was skipped
  late = tmp_path / "late.json"
  gpu.main(["--smoke", "--deadline", "0", "--out", str(late)])
  doc = json.loads(late.read_text())
  assert doc["status"] == "deadline"
  assert len(doc["skipped"]) == 2 * len(doc["results"])
  assert all(r[s]["status"] == "skipped" for r in doc["results"]
             for s in ("memory", "step", "largest_batch"))


def test_gpu_benchmark_batch_search_matches_brute_force():
  """The largest-batch search against memory curves that are not lines."""
  gpu = load_from("benchmarks", "accel_mlp")
  budget, granule, top = 200_000, 16, 2 ** 16
  curves = {
      "linear": lambda b: 1000 + 37 * b,
      "kink": lambda b: 1000 + 37 * b + (20_000 if b > 3000 else 0),
      "sublinear": lambda b: 1000 + int(1500 * b ** 0.5),
      "steps": lambda b: 1000 + 4096 * -(-b // 256),
      "nothing fits": lambda b: budget + b,
      "everything fits": lambda b: 5,
      # XLA refuses to compile (out of memory) past a batch the line puts
      # well under the budget: those probes are over, and give no line
      "refused past 2000": lambda b: 1000 + 37 * b if b <= 2000 else math.inf,
  }
  for name, memory in curves.items():
    search = gpu.BatchSearch(budget, granule, top, const_bytes=1000)
    search.add(64, memory(64), compiled_here=False)
    while not search.done():
      batch = search.next_probe()
      assert batch % granule == 0 and batch not in search.points, name
      search.add(batch, memory(batch))
    fits = [b for b in range(granule, top + 1, granule) if memory(b) <= budget]
    assert search.answer() == max(fits, default=0), name
    assert search.compiles <= 20, (name, search.compiles)
    json.dumps(search.summary(), allow_nan=False)


def test_architecture_walkthrough_is_current():
  import re
  import jax
  walk = load_from("design", "walkthrough")
  recorded = re.search(r"walkthrough.py` \(jax ([\d.]+)\)", open(walk.DOC).read())
  if recorded is None or recorded.group(1) != jax.__version__:
    pytest.skip("generated with another JAX version (jaxpr printing differs)")
  assert walk.main(["--check"]) == 0, "run: python design/walkthrough.py"


# -- every command of the README's examples table, as a user would run it -----

def readme_example_commands():
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  section = text[text.index("\n## Examples\n"):]
  section = section[:section.find("\n## ", 1)]
  commands = re.findall(r"^\| `(python [^`]+)` \|", section, re.M)
  assert commands, "no commands found in the README's examples table"
  return commands


COMMANDS = readme_example_commands()

# What each example's output must say, besides "Finished in": the labels
# that tell a reader what its numbers count and what they are compared to.
CONCLUSION = "What to conclude:"
LABELS = {
    "examples/seed_remat.py": ["The seed program is jax-ml/jax#21303's",
                               "Kernel launches per gradient step",
                               "also rule calls", "jnp.allclose",
                               "Where smartvjp beats jax.custom_vjp"
                               "(optimize_remat=True)", CONCLUSION],
    "examples/pallas_gelu_matmul.py": [
        "rule calls", "kernel launches", "max |ours - reference|",
        "When the fused rule pays", "arrays moved", "per call: f writes z",
        CONCLUSION],
    "examples/pallas_rmsnorm_gelu.py": [
        "rule calls", "arrays moved", "max |ours - reference| / max |reference|",
        CONCLUSION],
    # Without a GPU and jax_triton it prints one line saying what is missing.
    "examples/triton_gelu_matmul.py": ["Triton matmul+GELU (jax_triton.triton_call)",
                                       CONCLUSION],
    "examples/equinox_mlp.py": ["rule calls", "kernel launches",
                                "max |ours - equinox's|", "mean squared error",
                                CONCLUSION],
    "examples/blackbox_heat.py": ["max |ours - reference| / max |reference|",
                                  "each running every row once in turn",
                                  "median [min-max]", "same schedule",
                                  CONCLUSION],
    # Without the tesseract extra it prints one line saying what is missing.
    "examples/tesseract_heat.py": ["Tesseract example", CONCLUSION],
    # jax 0.12.1 removed the kernels it swaps: it says so and stops
    "examples/pallas_ops_transformer.py": [
        "Kernel launches per training step", "residual bytes written",
        "must be equal bit for bit", "losses bitwise equal yes",
        "parameters after the last step bitwise equal yes",
        "trains the\nsame model bit for bit", CONCLUSION]
    if _versions.SHIPS_TRITON_PALLAS_OPS else [
        "no longer ships the Triton", '"jax==0.12.0.1" "jaxlib==0.12.0.1"',
        CONCLUSION],
    "examples/ffi_kernel.py": ["Rules as", "rule calls",
                               "max |ours - 2 sin(x) cos(x)|", CONCLUSION],
}


def _run(command):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  argv = shlex.split(command)
  assert argv[0] == "python"
  t0 = time.perf_counter()
  try:
    done = subprocess.run([sys.executable] + argv[1:], cwd=ROOT, env=env,
                          capture_output=True, text=True,
                          timeout=EXAMPLE_TIMEOUT_S)
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - t0
  except subprocess.TimeoutExpired as e:
    return "timeout", e.stdout or "", e.stderr or "", EXAMPLE_TIMEOUT_S


@pytest.fixture(scope="module")
def example_runs(request):
  """Runs the table's commands that this session selected, two at a time
  (they are independent; CI's CPU has two cores)."""
  selected = [item.callspec.params["command"] for item in request.session.items
              if item.originalname == "test_readme_example_command"]
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    return dict(zip(selected, pool.map(_run, selected)))


def test_examples_table_lists_every_example():
  listed = {c.split()[1] for c in COMMANDS}
  present = {f"examples/{n}" for n in os.listdir(os.path.join(ROOT, "examples"))
             if n.endswith(".py")}
  assert listed == present
  assert set(LABELS) == present
  # the README: each "ends with What to conclude:", where it stops early too
  assert all(CONCLUSION in labels for labels in LABELS.values())


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_example_command(example_runs, command):
  rc, out, err, seconds = example_runs[command]
  assert rc == 0, f"{command} exited with {rc}:\n{out[-2000:]}\n{err[-3000:]}"
  tail = out[out.rfind(CONCLUSION):] if CONCLUSION in out else ""
  assert re.search(r"Finished in \d+\.\d s\.", out), out[-2000:]
  for bad in ("WRONG", "TOO LARGE", "Traceback"):
    assert bad not in out, f"{command} printed {bad}:\n{out}"
  for label in LABELS[command.split()[1]]:
    assert label in out, f"{command} does not print {label!r}:\n{out}"
  # it ends with its conclusion: after it, at most the time it took
  after = [p for p in tail.split("\n\n")[1:] if p.strip()]
  assert tail and all(p.strip().startswith("Finished in") for p in after), (
      f"{command} does not end with its conclusion:\n{out[-1500:]}")
