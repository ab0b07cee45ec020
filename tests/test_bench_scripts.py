"""The benchmark scripts' shared report (``benchmarks/_report.py``) and the
smoke modes of the timing benchmarks: each prints its machine, versions and
commit, every time as a median with its range, and a verdict per goal."""

import importlib.util
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


def load(name):
  spec = importlib.util.spec_from_file_location(
      f"smartvjp_bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module   # its dataclasses look their module up
  spec.loader.exec_module(module)
  return module


R = load("_report")
SPREAD = r"\d+\.\d+x? \[\d+\.\d+-\d+\.\d+\]"


def test_spread_and_goals():
  s = R.Spread([3.0, 1.0, 2.0, 10.0])
  assert (s.median, s.min, s.max) == (2.5, 1.0, 10.0)
  assert s.fmt(1e3, 0, " ms") == "2500 ms [1000-10000]"
  assert R.spread([0.5, 1.5, 1.0], digits=2, unit="x") == "1.00x [0.50-1.50]"
  assert R.paired_ratios([2, 6], [1, 3]) == [2.0, 2.0]
  with pytest.raises(ValueError):
    R.Spread([])
  goals = R.Goals()
  assert goals.check("a (1.0x)", True) and not goals.check("b (2.0x)", False)
  assert goals.lines() == ["goal a (1.0x): met", "goal b (2.0x): not met"]
  assert goals.summary() == 'verdict: 1 of 2 goals met (1 marked "not met" above)'
  assert not goals.all_met
  assert goals.as_list() == [dict(goal="a (1.0x)", met=True),
                             dict(goal="b (2.0x)", met=False)]


def test_header_names_the_machine_versions_and_commit():
  import jaxlib
  m, v = R.machine(), R.versions()
  assert m["cpu_count"] >= 1 and m["cpu_model"] and m["platform"]
  assert v["jax"] == jax.__version__ and v["jaxlib"] == jaxlib.__version__
  text = R.header(m, v)
  assert text.startswith(f"machine: {m['cpu_model']}, {m['cpu_count']} cores")
  assert f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, Python" in text
  commit = v["commit"]
  assert commit is None or re.fullmatch(r"[0-9a-f]{4,40}(\+changes)?", commit)
  assert f"commit {commit or 'unknown (no git)'}" in text
  # an older JSON without the newer fields still prints
  assert "commit unknown" in R.header(
      dict(device_kind="cpu", platform="cpu", device_count=1, host="h",
           cpu_count=2), dict(jax="0.1", jaxlib="0.1", python="3"))


def _common(out):
  assert "machine: " in out and f"jax {jax.__version__}, jaxlib " in out
  assert "smartvjp at commit " in out
  assert re.search(r"^verdict: (all \d+ goals met|\d+ of \d+ goals met)", out,
                   re.M), out
  for line in out.splitlines():
    if line.startswith("goal "):
      assert line.endswith((": met", ": not met")), line
  assert re.search(r"Finished in \d+\.\d s\.", out)


def test_overhead_smoke(capsys, monkeypatch):
  overhead = load("overhead")
  # the scanned model only (each round compiles every row twice)
  monkeypatch.setattr(overhead, "MODELS", overhead.MODELS[1:])
  rows, eager, goals = overhead.main(["--smoke", "--layers", "1",
                                      "--eager-calls", "5"])
  out = capsys.readouterr().out
  _common(out)
  assert len(rows) == 2 and all(len(s) == 3 for s in eager.values())
  for _, _, res in rows:
    assert all(len(tl) == len(cc) == 3 for tl, cc in res.values())
  # a spread for every time and ratio; a verdict per row and goal
  table = [l for l in out.splitlines() if l.startswith("scanned")]
  assert len(table) == 4 and all(len(re.findall(SPREAD, l)) == 3 for l in table)
  assert len(goals.items) == 2 + 2 + 1
  assert "trace+lower <= 1.05x jax.custom_vjp, scanned, no remat" in out
  assert "compile within noise, scanned, remat" in out


def test_tesseract_smoke(capsys):
  pytest.importorskip("tesseract_jax", reason="the tesseract extra")
  bench = load("tesseract")
  out, goals = bench.main(["--smoke"])
  text = capsys.readouterr().out
  _common(text)
  assert set(out) == {"in-process", "served over HTTP"}
  # per place: calls and values for 7 rows, the contract's step, forward
  # mode; then the gradient and jacfwd against the pure-JAX solver
  assert len(goals.items) == 2 * (2 * 7 + 2) + 2 * 2
  # the gates that hold at any size: calls and values
  for text_, ok in goals.items:
    if ("endpoint calls" in text_ or "equal to tesseract-jax" in text_
        or "pure-JAX solver" in text_):
      assert ok, text_
  assert not jax.config.jax_enable_x64     # the run left JAX's state alone


def test_blackbox_smoke(capsys):
  blackbox = load("blackbox")
  rows, heat_rows, goals = blackbox.main(["--smoke", "--layers", "2"])
  out = capsys.readouterr().out
  _common(out)
  assert "--unit-ms 8" in blackbox.__doc__    # the usage line's default
  assert len(rows) == 8 and len(heat_rows) == 3 and len(goals.items) == 3
  for row in rows + heat_rows:
    assert len(row["step"]) == 3
  lines = [l for l in out.splitlines() if l.startswith(("yes ", "no "))]
  assert len(lines) == 8 and all(len(re.findall(SPREAD, l)) == 3 for l in lines)


def test_scaling_smoke(capsys):
  scaling = load("scaling")
  results = scaling.main(["--smoke", "--max-layers", "1"])
  out = capsys.readouterr().out
  assert "machine: " in out and "smartvjp at commit " in out
  assert "No goal here" in out
  for impl, rows in results.items():
    (layers, samples, memory), = rows
    assert layers == 1 and len(samples) == 3 and memory > 0
  row = next(l for l in out.splitlines() if l.strip().startswith("1 "))
  assert len(re.findall(r"\d+\.\d+ \[\d+\.\d+-\d+\.\d+\] / ", row)) == 4


def test_tpu_attention_counts_off_a_tpu(capsys):
  # JAX's shipped Pallas TPU flash attention, lowered for a TPU without one:
  # swapped, each checkpointed call launches the kernel without l and m
  # forward and the one that writes them once (shipped: that one twice)
  bench = load("tpu_attention")
  if jax.default_backend() == "tpu":
    pytest.skip("on a TPU the script also times steps: run it by hand")
  doc, goals = bench.main([])
  out = capsys.readouterr().out
  assert goals.all_met and len(goals.items) == 4, out
  layers = bench.SMOKE_CONFIG.layers
  for policy in bench.POLICIES:
    counted = doc["policies"][policy]["launches"]
    shipped, swapped = counted["shipped"], counted["swapped"]
    fwd1, fwd3 = ("_flash_attention_kernel (1 output)",
                  "_flash_attention_kernel (3 outputs)")
    assert shipped["by_kernel"].get(fwd1, 0) == 0
    assert shipped["by_kernel"][fwd3] == 2 * layers
    assert swapped["by_kernel"][fwd1] == swapped["by_kernel"][fwd3] == layers
    for bwd in ("_flash_attention_dkv_kernel (2 outputs)",
                "_flash_attention_dq_kernel (1 output)"):
      assert shipped["by_kernel"][bwd] == swapped["by_kernel"][bwd] == layers
    assert 2 * swapped["residual_bytes"] == shipped["residual_bytes"] > 0


def test_tpu_tiles_says_it_needs_a_tpu(capsys):
  bench = load("tpu_tiles")
  if jax.default_backend() == "tpu":
    pytest.skip("on a TPU the script runs the search: run it by hand")
  assert bench.main([]) is None
  assert "no TPU here" in capsys.readouterr().out


def test_tpu_lm_kernel_launches_off_a_tpu():
  """The LM's columns lowered for a TPU (the example kernels and JAX's flash
  attention as Mosaic calls): per step, under nothing_saveable, the
  kernel columns run the same backward kernels and smartvjp writes the
  residuals of each kernel once where jax.custom_vjp writes them twice."""
  lm = load("tpu_lm")
  EX = lm.EX
  cfg = lm.Config(layers=2, width=256, heads=2, seq=256, vocab=512, mlp=512,
                  batch=1)
  policy = lm.POLICIES["nothing_saveable"]
  tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
  counts = {}
  for column in lm.KERNEL_COLUMNS:
    step = lm.make_train_step(cfg, column, policy, smoke=False)
    lowered = step.trace(lm.state_shapes(cfg), tokens).lower(
        lowering_platforms=("tpu",))
    counts[column] = {(k.name, len(k.outputs)): n for k, n in
                      EX.kernel_launches(lowered.compiler_ir()).items()}
  L = cfg.layers
  shipped, smart, fused = (counts["jax.custom_vjp"], counts["smartvjp"],
                           counts["smartvjp+fused"])
  assert shipped[("_flash_attention_kernel", 3)] == 2 * L
  assert smart[("_flash_attention_kernel", 3)] == L
  assert smart[("_flash_attention_kernel", 1)] == L
  assert shipped[("gelu_matmul_fwd", 2)] == 2 * L
  assert smart[("gelu_matmul_fwd", 2)] == smart[("gelu_matmul_f", 1)] == L
  assert shipped[("rmsnorm_gelu_fwd", 3)] == 4 * L
  assert smart[("rmsnorm_gelu_fwd", 3)] == smart[("rmsnorm_gelu_f", 1)] == 2 * L
  opt = counts["optimize_remat"]     # the kernels' f forward; flash shipped
  assert opt[("gelu_matmul_f", 1)] == opt[("gelu_matmul_fwd", 2)] == L
  assert opt[("_flash_attention_kernel", 3)] == 2 * L
  # the fused rules: the backward region reads each kernel's output (the
  # next matmul's gradient does), so the pairs are weighed with the
  # kernels' cost estimates: the matmul's fused rule (three matmuls) and the
  # norm's (fwd_bwd recomputes the norm) cost more than fwd + bwd, which run
  assert fused[("gelu_matmul_f", 1)] == fused[("gelu_matmul_fwd", 2)] == L
  assert ("gelu_matmul_fused_dx", 1) not in fused
  assert fused[("rmsnorm_gelu_fwd", 3)] == fused[("rmsnorm_gelu_f", 1)] == 2 * L
  assert ("rmsnorm_gelu_fwd_bwd", 2) not in fused
  for column in lm.KERNEL_COLUMNS:
    c = counts[column]
    assert c[("_flash_attention_dkv_kernel", 2)] == L
    assert c[("_flash_attention_dq_kernel", 1)] == L


def test_tpu_lm_splash_attention_swapped_and_lowered():
  """Issue 64: splash attention as the LM's kernel: its swapped copy's
  gradients are bitwise the shipped kernel's (interpret mode, a CPU), the
  trial names a fastest kernel among those that ran, and lowered for a TPU
  the swapped LM runs splash's residual-writing forward once per layer
  (shipped: twice) and the forward without residuals in its place."""
  lm = load("tpu_lm")
  cfg = lm.Config(layers=2, width=256, heads=2, seq=256, vocab=512, mlp=512,
                  batch=1)
  trial = lm.attention_trial(cfg, rounds=1, inner=1, interpret=True,
                             names=["splash"])
  assert trial["kernels"]["splash"]["swapped_grads_bitwise_equal"] is True
  assert trial["fastest"] == "splash"
  tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
  counts = {}
  for column in ("jax.custom_vjp", "smartvjp"):
    step = lm.make_train_step(cfg, column, lm.POLICIES["nothing_saveable"],
                              smoke=False, attention="splash")
    lowered = step.trace(lm.state_shapes(cfg), tokens).lower(
        lowering_platforms=("tpu",))
    counts[column] = {k.name: n for k, n in lm.EX.kernel_launches(
        lowered.compiler_ir()).items() if k.name.startswith("splash")}
  L = cfg.layers
  assert counts["jax.custom_vjp"]["splash_mha_fwd_residuals"] == 2 * L
  assert "splash_mha_fwd_no_residuals" not in counts["jax.custom_vjp"]
  assert counts["smartvjp"]["splash_mha_fwd_residuals"] == L
  assert counts["smartvjp"]["splash_mha_fwd_no_residuals"] == L
  for c in counts.values():
    assert c["splash_mha_dkv_no_residuals"] == c["splash_mha_dq_no_residuals"] == L


@pytest.mark.parametrize("policy", ["dots_saveable", "save_only_x_mid",
                                    "save_kernel_outputs"])
def test_tpu_lm_fused_column_launches_no_more_kernels(policy):
  """Issue 55: under every policy the LM's fused column launches no more of
  the two kernels than the smartvjp column (lowered for a TPU, off one);
  where the policy saves the kernels' outputs, fewer."""
  lm = load("tpu_lm")
  cfg = lm.Config(layers=2, width=256, heads=2, seq=256, vocab=512, mlp=512,
                  batch=1)
  tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
  runs = {}
  for column in ("smartvjp", "smartvjp+fused"):
    step = lm.make_train_step(cfg, column, lm.POLICIES[policy], smoke=False)
    lowered = step.trace(lm.state_shapes(cfg), tokens).lower(
        lowering_platforms=("tpu",))
    runs[column] = sum(n for k, n in lm.EX.kernel_launches(
        lowered.compiler_ir()).items() if "flash" not in k.name)
  assert runs["smartvjp+fused"] <= runs["smartvjp"], runs
  if policy == "save_kernel_outputs":
    assert runs["smartvjp+fused"] < runs["smartvjp"], runs


def test_tpu_lm_smoke(capsys):
  """The LM loop on the CPU at a tiny size (attention in jnp): losses fall,
  the kernel columns' curves are equal bit for bit to jax.custom_vjp's."""
  lm = load("tpu_lm")
  if jax.default_backend() == "tpu":
    pytest.skip("on a TPU the script trains the real model: run it by hand")
  doc, goals = lm.main(["--smoke", "--policies", "nothing_saveable",
                        "--columns", "xla", "jax.custom_vjp", "smartvjp",
                        "--steps", "3", "--rounds", "2"])
  res = doc["policies"]["nothing_saveable"]["columns"]
  assert res["smartvjp"]["loss"] == res["jax.custom_vjp"]["loss"]
  assert res["smartvjp"]["loss"][-1] < res["smartvjp"]["loss"][0]
  assert res["smartvjp"]["loss_bitwise_equal_custom_vjp"]
  for rec in res.values():
    assert rec["first_step_s"]["total"] > 0 and rec["memory_bytes"] > 0
    assert rec["step_s"]["median"] > 0 and rec["tokens_per_s"] > 0
  assert "verdict" in capsys.readouterr().out


def test_counts_debug_row_prints_nothing(capfd):
  """The "debug print in fwd" row of benchmarks/counts.py has a debug
  effect in fwd but writes nothing, so that no line comes before the
  report's header."""
  counts = load("counts")
  rules = counts.debug_fwd_rules()
  F = jax.custom_vjp(rules["f"])
  F.defvjp(rules["fwd"], rules["bwd"])
  x = jax.numpy.ones(3)
  program = jax.make_jaxpr(jax.grad(counts.remat_loss(F)))(x)
  assert "debug_callback" in str(program)
  jax.block_until_ready(jax.jit(jax.grad(counts.remat_loss(F)))(x))
  jax.effects_barrier()
  out, err = capfd.readouterr()
  assert out == "" and "fwd ran" not in err, (out, err)


def test_accel_profile_smoke(tmp_path, capsys):
  """The profile of the stack on the CPU: every row's ops found in the trace,
  the step's matmuls charged to a dot class, and the HLO written beside."""
  bench = load("accel_profile")
  out = tmp_path / "p.json"
  doc = bench.main(["--smoke", "--steps", "1", "--workload", "gelu_matmul",
                    "--impls", "xla", "smartvjp", "--out", str(out)])
  assert not doc["errors"], doc["errors"]
  assert [r["impl"] for r in doc["results"]] == ["xla", "smartvjp"]
  for r in doc["results"]:
    assert r["busy_ms"] > 0 and r["top"]
  hlo = sorted(p.name for p in (tmp_path / "p_hlo").iterdir())
  assert hlo == ["gelu_matmul_32_smartvjp.hlo.txt.gz",
                 "gelu_matmul_32_xla.hlo.txt.gz"]


def test_accel_profile_reads_optimized_hlo():
  bench = load("accel_profile")
  f = jax.jit(lambda a, b: jnp.tanh(a @ b) + 1)
  text = f.lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile().as_text()
  index = bench.hlo_index(text)
  classes = {bench.op_class(i) for i in index.values()}
  assert classes & {"dot (XLA matmul)", "fusion with dot (XLA matmul)"}
  assert bench.op_class(None) == "unknown"
  assert bench.op_class(dict(opcode="custom-call", target="tpu_custom_call",
                             kernel="gelu_matmul_f")) == "kernel gelu_matmul_f"


def test_tpu_tiles_ranks_candidates_by_their_rules():
  bench = load("tpu_tiles")
  t = lambda s: dict(median_s=s)
  search = dict(hidden=2048, candidates=[
      dict(kind="fwd", tiles=[1, 1, 1], f=t(3.0), fwd=t(1.0)),
      dict(kind="fwd", tiles=[2, 2, 2], f=t(1.5), fwd=t(2.0)),
      dict(kind="fwd", tiles=[3, 3, 3], error="VMEM"),
      dict(kind="dx", tiles=[4, 4, 4], bwd=t(2.0)),
      dict(kind="dx", tiles=[5, 5, 5], bwd=t(1.0))])
  assert [c["tiles"] for c in bench.ranked(search, "fwd")] == [[2, 2, 2],
                                                                [1, 1, 1]]
  assert [c["tiles"] for c in bench.ranked(search, "dx")] == [[5, 5, 5],
                                                               [4, 4, 4]]
  assert bench.ranked(search, "dw") == []
  for kind, default in bench.PG.TPU_TILES.items():   # always a candidate
    assert kind in bench.MM_CANDIDATES and len(default) == 3


def test_tpu_tiles_loop_chains_one_kernel_per_call():
  """The RMSNorm timing program: one kernel launch inside a while loop (the
  chained calls are neither hoisted nor merged), lowered for a TPU."""
  bench = load("tpu_tiles")
  _, rules = bench.RG.make_rmsnorm_gelu(target="tpu", interpret=False)
  x = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
  gamma = jax.ShapeDtypeStruct((2048,), jnp.bfloat16)
  for step, args in (
      (lambda c, gm: rules["f"](c, gm), (x, gamma)),
      (lambda c, x, gm: rules["fwd_bwd"](x, gm, c)[0], (x, x, gamma)),
      (bench._pallas_copy(2**22), (x,))):
    prog, _, _ = bench._looped(step, *args)
    text = prog.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1 and "stablehlo.while" in text


def test_tpu_lm_largest_batch_searches_up_to_the_budget(monkeypatch):
  """The LM's search goes past the line's first guess until a batch fits and
  the next does not; compiles that fail count as not fitting."""
  bench = load("tpu_lm")
  budget = 16_000
  curves = {"line": lambda b: 1000 + 600 * b,           # 25 fits
            "refused": lambda b: None if b > 19 else 1000 + 300 * b,
            "flat then steep": lambda b: 1000 + 100 * b + (
                10_000 if b > 30 else 0)}
  for name, curve in curves.items():
    def compile_at(cfg, column, policy, smoke, batch, curve=curve):
      if curve(batch) is None:
        raise RuntimeError("RESOURCE_EXHAUSTED")
      return batch

    monkeypatch.setattr(bench, "compile_at", compile_at)
    monkeypatch.setattr(bench, "memory_bytes", curve)
    cfg = bench.SMOKE_CONFIG
    big, summary = bench.largest_batch(cfg, "smartvjp", None, True,
                                       curve(cfg.batch), budget)
    fits = [b for b in range(1, bench.MAX_BATCH + 1)
            if curve(b) is not None and curve(b) <= budget]
    assert big == summary["batch"] == max(fits), name
    json.dumps(summary, allow_nan=False)


def test_accel_profile_joins_tpu_event_names_and_keeps_loops_apart():
  """On a TPU an event is named by its instruction's whole HLO text; a
  ``while`` spans the ops it runs, so it is not added to the busy time."""
  bench = load("accel_profile")
  index = {"fusion.3": dict(opcode="fusion", kind="kLoop", has_dot=True),
           "while.5": dict(opcode="while"),
           "k.1": dict(opcode="custom-call", target="tpu_custom_call",
                       kernel="gelu_matmul_f")}
  ops = [("%while.5 = (s32[], bf16[8,128]) while(%tuple.1), body=%b", 10_000_000),
         ("%fusion.3 = bf16[8,128]{1,0:T(8,128)} fusion(%p), kind=kLoop", 3_000_000),
         ("%k.1 = bf16[8,128] custom-call(%a), custom_call_target=\"x\"", 5_000_000)]
  s = bench.summarize(ops, index, steps=1, top=5)
  assert s["loops_ms"] == 10.0 and s["busy_ms"] == 8.0
  assert s["classes"] == {"kernel gelu_matmul_f": 5.0,
                          "fusion with dot (XLA matmul)": 3.0}
  assert bench.event_instruction("fusion.3") == "fusion.3"


def test_tpu_figure_title_comes_from_the_json():
  """Issue 58: the title was written by hand and went stale (it said rows
  did not compile after they did); now it names the chip, the JAX versions
  and the commits of the JSON, and a group measured against XLA only where
  its jax.custom_vjp row did not run."""
  spec = importlib.util.spec_from_file_location(
      "smartvjp_tpu_figures", os.path.join(ROOT, "tools", "tpu_figures.py"))
  figures = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(figures)
  mlp, lm = figures.load()
  text = figures.title(mlp, lm)
  assert mlp["machine"]["device_kind"] in text
  for commit in {mlp["versions"]["commit"]} | {r["commit"] for r in lm.values()}:
    assert commit in text
  assert "did not run" not in text   # every jax.custom_vjp row ran
  failed = json.loads(json.dumps(mlp))
  for r in failed["results"]:
    if (r["workload"], r["hidden"], r["impl"]) == ("gelu_matmul", 4096,
                                                   "jax.custom_vjp"):
      r["step"] = dict(status="error")
  assert "(gelu_matmul 4096: relative to xla" in figures.title(failed, lm)
