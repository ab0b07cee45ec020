"""``smartvjp.audit``: its counts equal what runs, on the README's contract
rows and on programs from the differential fuzzer, on JAX's default path and
under the remat3 flags; bad input gets a clear message.

"What runs" is counted by the kernels themselves at execution (host
callbacks: ``kernels.py``'s, and ``RunCounter``'s counting step), in the
very executables the audit compiled and counted (``Audit._builds``), so the
audit is checked against the program it describes, not a re-trace of it.
"""

import json
import os
import pathlib
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
import smartvjp
from smartvjp import smart_custom_vjp
from smartvjp.testing import RunCounter

ROOT = pathlib.Path(__file__).resolve().parent.parent
X = jnp.array([0.3, -1.2, 2.0], jnp.float32)
P = jax.checkpoint_policies


def executed(a, config, *args):
  """The kernel counts of one run of the audit's compiled ``config``."""
  K.reset()
  jax.block_until_ready(a._builds[config].compiled(*args))
  return {k: v for k, v in K.COUNTS.items() if v}


def compiled(a, config, where="compiled"):
  (runs,) = a.runs(config, where).values()
  return {k: v for k, v in runs.items() if v}


# -- the README's contract table, row by row ----------------------------------------

def _rules(never_dce, named=None, seed_fwd=False):
  f, fwd, bwd, fb = K.sin_rules(never_dce)
  if seed_fwd:
    def fwd(x):
      (y,) = K.kernel("fwd", lambda x: (np.sin(x),), [x], x,
                      never_dce=never_dce)
      return y, (x,)

    def bwd(res, g):
      (dx,) = K.kernel("bwd", lambda x, g: (np.cos(x) * g,), [g], res[0], g,
                       never_dce=never_dce)
      return (dx,)
  if named:
    plain = fwd

    def fwd(x):
      y, (c,) = plain(x)
      return y, (jax.ad_checkpoint.checkpoint_name(c, named),)
  return f, fwd, bwd, fb


def _loss(F, remat=False, policy=None):
  G = jax.checkpoint(F, policy=policy) if remat else F
  return lambda x: jnp.sum(G(x) ** 2)


def _scan(F):
  body = lambda c, _: (jax.checkpoint(F)(c), None)
  return lambda x: jnp.sum(jax.lax.scan(body, x, None, length=4)[0] ** 2)


# row: (program, rules options, jax.custom_vjp's counts, smartvjp's counts)
ROWS = {
    "primal": (lambda F: F, {}, {"f": 1}, {"f": 1}),
    "grad": (lambda F: jax.grad(_loss(F)), {}, {"fwd": 1, "bwd": 1},
             {"fwd": 1, "bwd": 1}),
    "grad_checkpoint": (lambda F: jax.grad(_loss(F, True)), {},
                        {"fwd": 2, "bwd": 1}, {"f": 1, "fwd": 1, "bwd": 1}),
    "seed_fwd": (lambda F: jax.grad(_loss(F, True)), {"seed_fwd": True},
                 {"fwd": 2, "bwd": 1}, {"f": 1, "bwd": 1}),
    "scan": (lambda F: jax.grad(_scan(F)), {}, {"fwd": 8, "bwd": 4},
             {"f": 4, "fwd": 4, "bwd": 4}),
    "everything_saveable": (
        lambda F: jax.grad(_loss(F, True, P.everything_saveable)), {},
        {"fwd": 1, "bwd": 1}, {"fwd": 1, "bwd": 1}),
    "named_saved": (
        lambda F: jax.grad(_loss(F, True, P.save_only_these_names("r"))),
        {"named": "r"}, {"fwd": 2, "bwd": 1}, {"fwd": 1, "bwd": 1}),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_contract_row(row, never_dce, ad_mode):
  make, opts, jax_counts, smart_counts = ROWS[row]
  F = jax.custom_vjp(_rules(never_dce, **opts)[0])
  F.defvjp(*_rules(never_dce, **opts)[1:3])
  a = smartvjp.audit(make(F), X)
  for config in a.data["configs"]:
    assert compiled(a, config) == executed(a, config, X), config
  assert compiled(a, "smartvjp") == smart_counts
  if never_dce and ad_mode == "default":
    # the README's JAX column: JAX's default path, kernels nothing removes
    # (JAX and XLA remove a callback kernel whose outputs are all unused)
    assert compiled(a, "as_written") == jax_counts
    assert compiled(a, "as_written", "jaxpr") == jax_counts


def test_contract_row_fwd_bwd(never_dce, ad_mode):
  f, fwd, bwd, fb = _rules(never_dce)
  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd, fwd_bwd=fb)
  a = smartvjp.audit(jax.grad(_loss(F, True)), X)
  assert compiled(a, "smartvjp_fused") == {"f": 1, "fwd_bwd": 1}
  assert compiled(a, "smartvjp") == {"f": 1, "fwd": 1, "bwd": 1}
  if ad_mode == "default":
    assert compiled(a, "as_written") == {"fwd": 2, "bwd": 1}
  for config in a.data["configs"]:
    assert compiled(a, config) == executed(a, config, X), config
  (site,) = a.sites
  assert site["kind"] == "smart_custom_vjp" and site["opaque"]
  assert a.predicted["launches_saved"] == 1
  assert a.predicted["candidate"] == "smartvjp_fused"


def test_site_identity_residuals_and_suggestion(ad_mode):
  f, fwd, bwd, _ = _rules(True)
  F = jax.custom_vjp(f)
  F.defvjp(fwd, bwd)
  a = smartvjp.audit(jax.grad(_scan(F)), jax.ShapeDtypeStruct((3,), jnp.float32))
  (s,) = a.sites
  assert s["name"] == "kernels.f" and s["rules"]["fwd"] == "kernels.fwd"
  assert s["defined_at"].endswith("kernels.py:%d" % (
      f.__code__.co_firstlineno))
  assert all(c.endswith(f"test_audit.py:{_scan.__code__.co_firstlineno + 1}")
             for c in s["called_at"])
  # under the remat3 flags, jax 0.10's jax.checkpoint leaves no equation
  # behind, only its name stack (and no policy to read); 0.11+ leaves a
  # call_hi_primitive whose RematTraced holds the policy
  assert s["path"] == ("jit › scan(×4) › checkpoint(?)"
                       if ad_mode == "remat3" and not _remat3_equation()
                       else "jit › scan(×4) › checkpoint(nothing_saveable)")
  assert s["multiplicity"] == 4 and s["remat"] and s["opaque"]
  (leaf,) = s["residuals"]
  assert (leaf["shape"], leaf["dtype"], leaf["bytes"]) == ([3], "float32", 12)
  assert leaf["fate"]["smartvjp"] == "recomputed"
  if ad_mode == "default":   # (jax.custom_vjp under the remat3 flags of
    # jax 0.10 runs f forward already: nothing dropped)
    assert leaf["fate"]["as_written"] == "dropped"
    assert s["residual_bytes"]["as_written"] == {
        "written": 48, "saved": 0, "dropped": 48, "recomputed": 0}
    # fwd runs 8 -> 4, f is a kernel too: 12 launches either way; the time
    # model cannot see the callbacks' work and gives no seconds (issue 68:
    # it said 0.0%, "within noise"), so the counts decide
    assert s["runs"]["as_written"]["compiled"]["fwd"] == 8
    assert s["runs"]["smartvjp"]["compiled"]["fwd"] == 4
    assert s["predicted"]["share_of_step"] is None
    assert s["suggestion"].startswith("swap: ")
    assert "(the time model: unpriced: calibrate=True times it)" in \
        s["suggestion"]
    assert s["advice"] == "swap"


def _remat3_equation():
  """Whether this JAX, under the flags set now, leaves an equation holding
  the policy for a rematerialized region (a call_hi_primitive's _prim)."""
  F = jax.custom_vjp(jnp.sin)
  F.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g,))
  closed = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x))))(X)
  return any(hasattr(e.params.get("_prim"), "policy")
             for e in closed.jaxpr.eqns)


@pytest.mark.parametrize("policy,fate", [
    ("save_only_these_names", "saved"), ("nothing_saveable", "dropped")])
def test_policy_read_under_remat3_where_jax_leaves_it(ad_mode, policy, fate):
  """The policy, and each residual's fate under it, on JAX's default path
  and, where JAX leaves an equation holding it, under the remat3 flags."""
  if ad_mode == "remat3" and not _remat3_equation():
    pytest.skip(f"jax {jax.__version__} leaves no equation for a "
                "rematerialized region under the remat3 flags")
  f, fwd, bwd, _ = _rules(True, named="r")
  F = jax.custom_vjp(f)
  F.defvjp(fwd, bwd)
  pol = (P.save_only_these_names("r") if policy == "save_only_these_names"
         else P.nothing_saveable)
  a = smartvjp.audit(jax.grad(_loss(F, True, pol)), X,
                     configs=("as_written", "smartvjp"))
  (s,) = a.sites
  assert s["remat"] and "?" not in s["path"] and "unknown" not in s["policy"]
  if policy == "nothing_saveable":
    assert s["policy"] == policy
  (leaf,) = s["residuals"]
  assert leaf["name"] == "r"
  if ad_mode == "default" or fate == "saved":
    # (jax.custom_vjp under the remat3 flags runs f forward already)
    assert leaf["fate"]["as_written"] == fate
  assert leaf["fate"]["smartvjp"] == ("saved" if fate == "saved"
                                      else "recomputed")


def test_jax_coded_rules_count_twice_and_say_xla_removes_it():
  F = jax.custom_vjp(lambda x: jnp.sin(x))
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  a = smartvjp.audit(jax.grad(_loss(F, True)), X)
  (s,) = a.sites
  assert not s["opaque"]
  assert s["runs"]["as_written"]["jaxpr"]["fwd"] == 2
  assert s["suggestion"].startswith("no action: XLA already removes")
  assert s["residuals"][0]["fate"]["as_written"] == "recomputed"


# -- programs from the differential fuzzer ------------------------------------------

sys.path.insert(0, str(ROOT / "tools"))
import fuzz_dropin   # noqa: E402

COUNTER = RunCounter()
_INSTRUMENT = '''
import smartvjp.testing as _svt
def _counted(fn, name):
    def rule(*a, **k):
        out = fn(*a, **k)
        leaves, tree = jax.tree.flatten(out)
        pos = [i for i, l in enumerate(leaves) if hasattr(l, "dtype")
               and jnp.result_type(l) != jax.dtypes.float0]
        if pos:
            got = COUNTER.count(name, *[leaves[i] for i in pos])
            got = got if len(pos) > 1 else (got,)
            for i, v in zip(pos, got):
                leaves[i] = v
        return jax.tree.unflatten(tree, leaves)
    rule.__name__ = getattr(fn, "__name__", "rule")
    return rule
def DEC(fun=None, nondiff_argnums=()):
    if fun is None:
        return lambda f: DEC(f, nondiff_argnums)
    F = jax.custom_vjp(_counted(fun, fun.__name__ + ".f"),
                       nondiff_argnums=nondiff_argnums)
    F._name, F._raw = fun.__name__, fun
    return F
def DEFVJP(F, fwd, bwd, symbolic_zeros=False, fwd_bwd=None, only_fb=False):
    if only_fb:
        fwd = lambda *a: (F._raw(*a), a)
        bwd = lambda res, g: fwd_bwd(*res, g)
    F.defvjp(_counted(fwd, F._name + ".fwd"), _counted(bwd, F._name + ".bwd"),
             symbolic_zeros=symbolic_zeros)
'''


def _fuzz_program(seed):
  meta, src = fuzz_dropin.gen_program(seed, 0)
  if "shard_map" in src or meta["outer"] in ("jvp", "linearize", "hessian",
                                              "hvp", "vmap_hvp",
                                              "jacfwd_jacrev"):
    return None   # forward mode: jax.custom_vjp raises; shard_map: refused
  pre = fuzz_dropin.PRELUDE_REPRO.replace('KIND = "smart"', 'KIND = "jax"')
  ns = {"COUNTER": COUNTER}
  exec(compile(fuzz_dropin.HEADER + pre + _INSTRUMENT + src,
               f"<fuzz {seed}>", "exec"), ns)
  return ns["run"], ns["ARGS"]


def _fuzz_seeds(n):
  rng, seeds = random.Random(59), []
  while len(seeds) < n:
    seed = rng.randrange(10**6)
    if _fuzz_program(seed) is not None:
      seeds.append(seed)
  return seeds


CONFIGS = ("as_written", "smartvjp")


@pytest.mark.parametrize("chunk", range(4))
def test_fuzz_programs_counts_equal_runs(chunk, ad_mode):
  """32 programs (8 per chunk; 16 under the remat3 flags, to keep the suite
  fast): as written and swapped, the
  audit's compiled counts per rule equal RunCounter's at execution (under
  ``lax.cond``/``switch``, where the audit counts the costliest branch, at
  least RunCounter's)."""
  per = 8 if ad_mode == "default" else 4
  checked = 0
  for seed in _fuzz_seeds(32)[chunk * per:(chunk + 1) * per]:
    run, args = _fuzz_program(seed)
    try:
      a = smartvjp.audit(run, *args, configs=CONFIGS)
    except smartvjp.audit.AuditError as e:
      assert "does not trace" in str(e), (seed, e)
      continue
    for config in a.data["configs"]:
      COUNTER.reset()
      jax.block_until_ready(a._builds[config].compiled(*args))
      want = {k: v for k, v in COUNTER.counts.items() if v}
      got = {}
      for s in a.sites:
        for role, n in s["runs"][config]["compiled"].items():
          if n:
            key = s["name"].rsplit(".", 1)[-1] + "." + role
            got[key] = got.get(key, 0) + n
      if any(s["conditional"] for s in a.sites):
        # under lax.cond/switch: the costliest branch, at least what ran
        assert all(got.get(k, 0) >= n for k, n in want.items()), (
            seed, config, got, want)
      else:
        assert got == want, (seed, config, got, want)
    checked += 1
  assert checked >= per - 2, checked


# -- bad input ----------------------------------------------------------------------

def test_no_custom_vjp_is_a_clear_error():
  with pytest.raises(smartvjp.audit.AuditError, match="no jax.custom_vjp or "
                     "smart_custom_vjp call"):
    smartvjp.audit(lambda x: jnp.sin(x), X)


def test_untraceable_function_is_a_clear_error():
  def step(x):
    return jnp.sin(x) if x.sum() > 0 else x   # a tracer's bool
  with pytest.raises(smartvjp.audit.AuditError, match="step does not trace"):
    smartvjp.audit(step, X)


def test_donated_arguments_are_a_clear_error():
  F = jax.custom_vjp(lambda x: jnp.sin(x))
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  step = jax.jit(jax.grad(_loss(F)), donate_argnums=0)
  with pytest.raises(smartvjp.audit.AuditError, match="donated"):
    smartvjp.audit(step, X)


def test_site_under_shard_map_is_audited():
  F = jax.custom_vjp(lambda x: jnp.sin(x))
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("i",))
  sm = jax.shard_map(F, mesh=mesh, in_specs=jax.P("i"), out_specs=jax.P("i"))
  report = smartvjp.audit(jax.grad(lambda x: jnp.sum(sm(x))), X)
  (site,) = report.sites
  assert "shard_map" in site["path"]
  assert site["runs"]["as_written"]["jaxpr"]["fwd"] == 1


# -- the other forms --------------------------------------------------------------------

def _opaque_jax_site():
  f, fwd, bwd, _ = _rules(True)
  F = jax.custom_vjp(f)
  F.defvjp(fwd, bwd)
  return F


def test_assert_no_duplicate_fwd():
  F = _opaque_jax_site()
  with pytest.raises(AssertionError, match=r"kernels.f .*fwd runs 2x, bwd 1x"):
    smartvjp.audit.assert_no_duplicate_fwd(jax.grad(_loss(F, True)), X)
  S = smart_custom_vjp(F.fun)
  S.defvjp(F.fwd, F.bwd)
  a = smartvjp.audit.assert_no_duplicate_fwd(jax.grad(_loss(S, True)), X)
  assert compiled(a, "as_is") == {"f": 1, "fwd": 1, "bwd": 1}
  with pytest.raises(smartvjp.audit.AuditError, match="no jax.custom_vjp"):
    smartvjp.audit.assert_no_duplicate_fwd(jnp.sin, X)


def test_unknown_configuration_is_a_clear_error():
  with pytest.raises(ValueError, match="configs must be some of"):
    smartvjp.audit(jax.grad(_loss(_opaque_jax_site(), True)), X,
                   configs=("as_written", "defremat"))


def test_json_has_the_documented_schema(tmp_path):
  a = smartvjp.audit(jax.grad(_loss(_opaque_jax_site(), True)), X)
  data = json.loads(a.to_json(str(tmp_path / "a.json")))
  assert data["schema"] == smartvjp.audit.SCHEMA
  (s,) = data["sites"]
  for key in ("name", "defined_at", "called_at", "multiplicity", "opaque",
              "runs", "residual_bytes", "predicted", "suggestion", "hazards"):
    assert key in s, key
  assert set(s["runs"]) == {"as_written", "optimize_remat", "smartvjp",
                            "smartvjp_fused"}
  assert set(s["runs"]["smartvjp"]) >= {"jaxpr", "compiled"}
  assert set(s["residual_bytes"]["smartvjp"]) == {
      "written", "saved", "dropped", "recomputed"}
  doc = (ROOT / "docs" / "audit.md").read_text()
  for key in ("schema", "sites", "multiplicity", "residual_bytes",
              "predicted", "measured", "summary", "step"):
    assert f"`{key}`" in doc, key


def test_table_html_and_capture(capsys):
  F = _opaque_jax_site()
  step = jax.jit(jax.grad(_loss(F, True)))
  with smartvjp.audit.capture() as cap:
    watched = cap.watch(step)
    for _ in range(2):
      watched(X)
  assert "kernels.f" in capsys.readouterr().out
  assert cap.audit is not None
  pytest.importorskip("matplotlib")
  page = cap.audit.to_html()
  assert page.count("data:image/svg+xml;base64,") == 2
  assert "kernels.f" in page and "<table>" in page


def test_measure_reports_a_paired_ratio():
  F = jax.custom_vjp(lambda x: jnp.sin(x))
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  a = smartvjp.audit(jax.grad(_loss(F, True)), jax.ShapeDtypeStruct(
      (64,), jnp.float32), measure=True, timing_budget=1.0)
  m = a.measured
  assert m["pairs"] >= 1 and m["paired_ratio"] > 0
  assert set(m["seconds"]) == {"as_written", "smartvjp"}
  assert "paired" in a.table()


def test_cli_on_a_script(tmp_path):
  script = tmp_path / "train.py"
  script.write_text(
      "import jax, jax.numpy as jnp\n"
      "F = jax.custom_vjp(lambda x: jnp.sin(x))\n"
      "F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))\n"
      "def step(x=jnp.ones(3)):\n"
      "  return jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x)))(x)\n")
  out = tmp_path / "a.json"
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  subprocess.run([sys.executable, "-m", "smartvjp.audit",
                  f"{script}:step", "--json", str(out)],
                 check=True, env=env, cwd=tmp_path, timeout=300)
  data = json.loads(out.read_text())
  assert data["sites"][0]["runs"]["as_written"]["jaxpr"]["fwd"] == 2


def test_a_library_site_is_found_in_the_library_s_own_file():
  """equinox makes its jax.custom_vjp inside its own module when a
  filter_custom_vjp function is called: the audit finds it there, with no
  change to equinox."""
  eqx = pytest.importorskip("equinox")

  @eqx.filter_custom_vjp
  def f(x):
    return jnp.sin(x)

  @f.def_fwd
  def f_fwd(perturbed, x):
    return jnp.sin(x), jnp.cos(x)

  @f.def_bwd
  def f_bwd(res, g, perturbed, x):
    return g * res

  a = smartvjp.audit(jax.grad(lambda x: jnp.sum(jax.checkpoint(f)(x))), X)
  (s,) = a.sites
  assert s["kind"] == "jax.custom_vjp"
  assert os.sep + "equinox" + os.sep in s["defined_at"]
  assert all(os.sep + "equinox" + os.sep in c for c in s["called_at"])
  assert s["symbolic_zeros"]   # equinox's rules take symbolic zeros
  assert s["runs"]["smartvjp"]["jaxpr"]["f"] == 1


def test_a_loop_without_known_trip_count_reads_its_condition():
  """XLA's TPU backend prints no ``known_trip_count`` on a scan's ``while``
  (seen in benchmarks/results/audit_tpu_6181a0d.json, where the compiled
  counts came out per iteration): the trip count is then read from the
  loop's condition, ``counter < N``."""
  from smartvjp.audit import _count as C

  def body(c, _):
    with jax.named_scope(C.tag(0, 0, "fwd")):
      c = jnp.sin(c) * 2.0
    return c, None

  step = jax.jit(lambda x: jax.lax.scan(body, x, None, length=5)[0])
  text = step.lower(jnp.ones(3)).compile().as_text()
  assert C._TRIP.search(text), "the CPU backend states the trip count"
  stripped = C._TRIP.sub('"no_trip_count":{"n":"0"', text)
  want = C.count_hlo(text, lambda key: 1)
  got = C.count_hlo(stripped, lambda key: 1)
  assert want.runs[(0, 0, "fwd")] == 5
  assert got.runs == want.runs and not got.notes
  comps, _ = C.parse_hlo(stripped)
  loops = [i for c in comps.values() for i in c if i.opcode == "while"]
  assert [C.condition_bound(comps, i.callees["condition"])
          for i in loops] == [5]
  # the condition as XLA's TPU backend prints it (jax 0.10.2, TPU v5e)
  tpu = """\
%wide.region_1.3 (wide.arg_tuple.3: (s32[], f32[8,128], s32[])) -> pred[] {
  %constant.8 = s32[]{:T(128)} constant(5)
  %wide.arg_tuple.3 = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)S(1)}, s32[]{:T(128)}) parameter(0)
  %get-tuple-element.10 = s32[]{:T(128)} get-tuple-element(%wide.arg_tuple.3), index=0
  ROOT %lt.0 = pred[]{:T(512)} compare(%get-tuple-element.10, %constant.8), direction=LT, metadata={op_name="jit(<lambda>)/while/cond/lt"}
}
"""
  comps, _ = C.parse_hlo(tpu)
  assert C.condition_bound(comps, "wide.region_1.3") == 5
