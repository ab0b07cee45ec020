"""The audit on a new user's trial and on five libraries' shapes (issue 63,
"Why" items 5 and 6): each finding reproduced by a small program of the
same shape, and the measured estimator (``calibrate=True``)."""

import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartvjp
from smartvjp.audit import _calibrate, _count, _report
from smartvjp.audit._timing import Interval

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sin_site():
  f = jax.custom_vjp(lambda x: jnp.sin(x))
  f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  return f


def _nested_callback_site(delay=0.0):
  """A host-callback rule whose ``fwd`` calls the site itself (netket's
  and exojax's shape): JAX traces that ``fwd`` lazily under ``scan`` and
  stages the inner call, unused, at the top level of the step."""
  def host(x):
    time.sleep(delay)
    return np.asarray(np.sin(x), x.dtype)

  @jax.custom_vjp
  def hs(x):
    return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  hs.defvjp(lambda x: (hs(x), x), lambda x, g: (g * jnp.cos(x),))
  return hs


def _scanned(site, remat, n=4):
  def loss(ws, x):
    def body(c, w):
      layer = lambda c, w: site(c @ w)
      return (jax.checkpoint(layer) if remat else layer)(c, w), None
    return jnp.sum(jax.lax.scan(body, x, ws)[0])
  return jax.jit(jax.grad(loss)), (jnp.ones((n, 8, 8)) * 0.1, jnp.ones((4, 8)))


@pytest.mark.parametrize("remat", [True, False])
def test_a_dead_staged_call_is_not_a_run(remat):
  # netket/exojax: as-written jaxpr fwd 9 where 8 run (here 5 where 4)
  step, args = _scanned(_nested_callback_site(), remat)
  report = smartvjp.audit(step, *args, configs=("as_written", "smartvjp"))
  runs = report.sites[0]["runs"]["as_written"]
  assert runs["jaxpr"]["fwd"] == 4 and runs["compiled"]["fwd"] == 4
  assert runs["jaxpr"]["bwd"] == 4
  # the f this fwd calls is part of fwd's run, not a run of f (JAX's TPU
  # flash attention has this shape: as written it was counted f 16, fwd 16
  # for 16 kernel launches on the TPU at c420ac0)
  assert runs["jaxpr"]["f"] == 0 and runs["compiled"]["f"] == 0


def test_compiled_counts_never_exceed_the_jaxprs():
  step, args = _scanned(_nested_callback_site(), True)
  report = smartvjp.audit(step, *args)
  for s in report.sites:
    for config, runs in s["runs"].items():
      for role, n in runs["compiled"].items():
        assert n <= runs["jaxpr"][role], (s["name"], config, role)


def _cross_entropy_site():
  """A JAX-coded cross-entropy of fjformer's shape: two outputs (the loss
  and its z-loss term), seven residuals (inputs, a Python float, the
  softmax's parts) and a constant cotangent for the float."""
  @jax.custom_vjp
  def xent(logits, targets, zl):
    lse = jax.nn.logsumexp(logits, axis=-1)
    return (lse - jnp.sum(targets * logits, axis=-1) + zl * lse ** 2,
            zl * lse ** 2)

  def fwd(logits, targets, zl):
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    lse = (jnp.log(s) + m)[..., 0]
    ls = logits - lse[..., None]
    out = (-jnp.sum(targets * ls, axis=-1) + zl * lse ** 2, zl * lse ** 2)
    return out, (logits, targets, zl, e, s, ls, lse)

  def bwd(res, g):
    logits, targets, zl, e, s, ls, lse = res
    d = (1 + 2 * zl * lse)[..., None] * e / s - targets
    return g[0][..., None] * d, -g[0][..., None] * ls, jnp.array(0.0)
  xent.defvjp(fwd, bwd)
  return xent


@pytest.mark.parametrize("argnums", [(0,), (0, 2)])
def test_work_in_two_fusions_or_hoisted_is_one_run(argnums):
  # fjformer: compiled bwd 8 where 4 run. XLA joins the names of what it
  # fuses with ";" (0.10 and 0.12 alike), and hoists loop-invariant work of
  # bwd out of the loop (under the name it had inside): bwd 8 and 9 for 4
  site = _cross_entropy_site()

  def loss(w, xs, ts):
    def body(c, xt):
      return c + jnp.sum(site(xt[0] @ w, xt[1], 1e-4)[0]), None
    return jax.lax.scan(body, 0.0, (xs, ts))[0]

  report = smartvjp.audit(
      jax.grad(jax.checkpoint(loss), argnums=argnums),
      jnp.ones((16, 32)) * 0.1, jnp.ones((4, 8, 16)),
      jax.nn.one_hot(jnp.zeros((4, 8), int), 32))
  (s,) = report.sites
  for config, runs in s["runs"].items():
    assert runs["compiled"]["bwd"] == 4, (config, runs)
    for role, n in runs["compiled"].items():
      assert n <= runs["jaxpr"][role], (config, role, runs)


def test_joined_names_are_one_place():
  name = ("jit(f)/while/body/svjpaudit_0_0_bwd/mul;"
          "svjpaudit_0_0_bwd/broadcast_in_dim;broadcast_in_dim")
  assert _count._tags(name) == [
      ((0, 0, "bwd"), "jit(f)/while/body/svjpaudit_0_0_bwd")]
  two = "jit(f)/svjpaudit_0_0_fwd/exp;jit(f)/svjpaudit_1_0_bwd/mul"
  assert [k for k, _ in _count._tags(two)] == [(0, 0, "fwd"), (1, 0, "bwd")]


def test_a_site_under_shard_map_is_audited():
  # ringattention's sites are under shard_map: audited, not refused
  from jax.sharding import PartitionSpec as P
  shard_map = getattr(jax, "shard_map", None)
  if shard_map is None:
    from jax.experimental.shard_map import shard_map
  site, mesh = _sin_site(), jax.make_mesh((1,), ("d",))

  def body(x):
    y = jax.lax.scan(lambda c, _: (jax.checkpoint(site)(c), None), x, None,
                     length=3)[0]
    return jax.lax.psum(jnp.sum(y), "d")

  step = jax.grad(lambda x: shard_map(body, mesh=mesh, in_specs=P(),
                                      out_specs=P())(x))
  report = smartvjp.audit(step, jnp.ones(4), configs=("as_written",
                                                      "smartvjp"))
  (s,) = report.sites
  assert "shard_map" in s["path"]
  assert s["runs"]["as_written"]["jaxpr"] == dict(f=0, fwd=6, bwd=3,
                                                  fwd_bwd=0)
  assert s["runs"]["smartvjp"]["compiled"]["fwd"] == 3


def test_a_site_with_collectives_under_shard_map_is_audited():
  # ringattention's rules hold collectives: the site is counted; its rules,
  # traced alone outside the mesh, are reported as not tracing there
  from jax.sharding import PartitionSpec as P
  shard_map = getattr(jax, "shard_map", None)
  if shard_map is None:
    from jax.experimental.shard_map import shard_map
  mesh = jax.make_mesh((1,), ("d",))

  @jax.custom_vjp
  def ring(x):
    return jax.lax.psum(jnp.sin(x), "d")
  ring.defvjp(lambda x: (jax.lax.psum(jnp.sin(x), "d"), jnp.cos(x)),
              lambda c, g: (jax.lax.psum(c * g, "d"),))

  def body(x):
    return jnp.sum(jax.lax.scan(lambda c, _: (jax.checkpoint(ring)(c), None),
                                x, None, length=3)[0])

  step = jax.grad(lambda x: shard_map(body, mesh=mesh, in_specs=P(),
                                      out_specs=P())(x))
  report = smartvjp.audit(step, jnp.ones(4), calibrate=True,
                          timing_budget=0.2,
                          configs=("as_written", "smartvjp"))
  (s,) = report.sites
  assert s["runs"]["as_written"]["compiled"] == dict(f=0, fwd=6, bwd=3,
                                                     fwd_bwd=0)
  assert "fwd" in s["rule_errors"]
  assert "fwd" not in s["predicted"]["calibrated"]["rule_seconds"]


@pytest.mark.parametrize("make", [_sin_site, _nested_callback_site])
def test_a_swap_that_changes_nothing_is_predicted_to_change_nothing(make):
  # netket: swapped step predicted 9% slower where the swap changes nothing
  # XLA keeps (no remat: every configuration runs each rule once a layer).
  # A site whose fwd calls the site: its one callback carries the tags of
  # fwd and f, and was priced as two launches (predicted 0.505)
  n = 8
  step, args = _scanned(make(), False, n=n)
  report = smartvjp.audit(step, *args, configs=("as_written", "smartvjp"))
  ratio = report.predicted["predicted_ratio"]
  assert ratio is not None and abs(ratio - 1) < 0.02, ratio
  (s,) = report.sites
  launches = {c: v["kernel_launches"] for c, v in report.data["step"].items()}
  want = n if s["opaque"] else 0
  assert launches == {"as_written": want, "smartvjp": want}
  assert s["runs"]["as_written"]["kernel_launches"] == want


@pytest.mark.parametrize("static", ["argnames", "argnums"])
def test_measure_with_static_arguments(static):
  site = _sin_site()

  def step(x, scale=2.0):
    return jax.grad(lambda x: jnp.sum(jax.checkpoint(site)(x) * scale))(x)

  if static == "argnames":
    jitted = jax.jit(step, static_argnames=("scale",))
    report = smartvjp.audit(jitted, jnp.ones(3), scale=3.0, measure=True,
                            timing_budget=1.0,
                            configs=("as_written", "smartvjp"))
  else:
    jitted = jax.jit(step, static_argnums=(1,))
    report = smartvjp.audit(jitted, jnp.ones(3), 3.0, measure=True,
                            timing_budget=1.0,
                            configs=("as_written", "smartvjp"))
  assert report.measured["pairs"] >= 1
  assert report.measured["paired_ratio"] > 0


def test_argument_checks():
  site = _sin_site()
  step = lambda x, mode: jax.grad(lambda x: jnp.sum(site(x)))(x)
  with pytest.raises(TypeError, match="functools.partial"):
    smartvjp.audit(step, jnp.ones(3), "fast")
  with pytest.raises(ValueError, match="as_written"):
    smartvjp.audit(functools.partial(step, mode="fast"), jnp.ones(3),
                   configs=("smartvjp",))
  with pytest.raises(ValueError, match="as_written"):
    smartvjp.audit(functools.partial(step, mode="fast"), jnp.ones(3),
                   configs=("smartvjp", "as_written"))
  with pytest.raises(TypeError, match="measure must be True or False"):
    smartvjp.audit(functools.partial(step, mode="fast"), jnp.ones(3),
                   measure="yes")
  with pytest.raises(TypeError, match="calibrate must be True or False"):
    smartvjp.audit(functools.partial(step, mode="fast"), jnp.ones(3),
                   calibrate=1)
  with pytest.raises(TypeError, match="the step must be a function"):
    smartvjp.audit(3, jnp.ones(3))
  with pytest.raises(TypeError, match="peaks must be a dict"):
    smartvjp.audit(functools.partial(step, mode="fast"), jnp.ones(3),
                   peaks="tpu")
  for bad in ("fast", -1.0, 0, float("nan"), True):
    with pytest.raises(ValueError, match=r"peaks\['flops'\] must be a "
                       "positive number"):
      smartvjp.audit(functools.partial(step, mode="fast"), jnp.ones(3),
                     peaks={"flops": bad})


# -- the measured estimator ----------------------------------------------------------

@pytest.mark.parametrize("predicted,measured,spread,want", [
    (0.10, 0.12, None, True),       # within a quarter
    (0.05, 0.12, None, False),
    (0.20, 0.12, None, False),
    (0.004, 0.006, None, True),     # within 1 point of the step
    (0.0, 0.006, None, True),
    (0.0, 0.03, None, False),
    (0.0, 0.11, (0.10, 0.12), False),     # the model's 0.0% against 11%
    (0.0, 0.11, (-0.05, 0.31), None),     # its interval is too wide to tell
    (0.026, 0.23, None, False),     # the user's 0.974 against 0.770
    (None, 0.1, None, None),
])
def test_agrees_table(predicted, measured, spread, want):
  # issue 68 item 6: against the measurement's 95% interval, not its IQR;
  # where that interval is wider than the band, it cannot tell (None)
  lo, hi = spread or (measured, measured)
  got = _calibrate.agreement(predicted, Interval(measured, lo, hi, 0))
  assert {"agrees": True, "disagrees": False, "cannot tell": None,
          None: None}[got] is want


def _callback_pair(delay):
  """A site whose ``fwd`` is a host callback taking ``delay`` seconds and
  whose ``f`` is a cheap one: under remat, as written runs ``fwd`` twice
  a layer, swapped ``f`` then ``fwd``."""
  def slow(x):
    time.sleep(delay)
    return np.asarray(np.sin(x), x.dtype)

  def quick(x):
    return np.asarray(np.sin(x), x.dtype)

  def call(fn, x):
    return jax.pure_callback(fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

  site = jax.custom_vjp(lambda x: call(quick, x))
  site.defvjp(lambda x: (call(slow, x), x), lambda x, g: (g * jnp.cos(x),))
  return site


def test_host_callbacks_priced_from_a_measurement():
  delay = 0.005
  step, args = _scanned(_callback_pair(delay), True, n=3)
  report = smartvjp.audit(step, *args, calibrate=True, timing_budget=0.5,
                          configs=("as_written", "smartvjp"))
  (s,) = report.sites
  assert s["opaque"]
  cal = s["predicted"]["calibrated"]
  # the callback sleeps `delay`: timed, it takes at least that, from the
  # clock alone (nothing subtracted)
  assert cal["rule_seconds"]["fwd"]["seconds"] >= delay
  assert cal["rule_seconds"]["fwd"]["low"] >= delay
  runs = s["runs"]
  saved_fwd = (runs["as_written"]["compiled"]["fwd"]
               - runs["smartvjp"]["compiled"]["fwd"])
  assert saved_fwd == 3
  # three fwd runs saved, three cheap f runs added: at least 3 x delay / 2
  assert cal["seconds_saved"] >= 3 * delay / 2
  # the time model cannot see a callback's cost: it gives the site none
  assert s["predicted"]["seconds_saved"] is None
  assert s["predicted"]["unpriced"] == {r: ["pure_callback"]
                                        for r in ("f", "fwd")}
  assert report.data["calibrated"]["seconds_saved"] == pytest.approx(
      cal["seconds_saved"])
  # the share is of the as-written step, timed beside the rules
  step_time = report.data["step_time"]
  assert step_time["low"] <= step_time["median"] <= step_time["high"]
  # the step runs the slow fwd as often as the count says
  assert step_time["low"] >= runs["as_written"]["compiled"]["fwd"] * delay
  assert cal["share_of_step"] == pytest.approx(
      cal["seconds_saved"] / step_time["median"], rel=0.5)
  lo, hi = cal["share_of_step_interval"]
  assert lo <= cal["share_of_step"] <= hi
  text = report.table()
  assert "(its rules timed)" in text
  assert text.index("(its rules timed)") < text.index(
      "model saving: —, unpriced: calibrate=True times it")
  cost = report.data["audit_cost"]
  assert cost["total_s"] >= cost["trace_compile_s"] + cost["rule_timing_s"]
  assert f"audit took {cost['total_s']:.2f} s" in text


def test_verdict_against_the_measurements_interval():
  data = dict(
      calibrated=dict(share_of_step=0.026),
      measured=dict(paired_ratio=0.770, measured_saving_interval=[0.22, 0.24],
                    predicted_ratio=0.974, summary="s"),
      sites=[dict(suggestion="swap: decorate f", advice="swap"),
             dict(suggestion="none: left as JAX's (refused)",
                  advice="no action")])
  _calibrate.verdict(data)
  m = data["measured"]
  assert m["disagrees"] is True
  assert m["agrees"] == {"calibrated": "disagrees", "model": "disagrees"}
  assert data["sites"][0]["suggestion"].startswith("cannot tell")
  assert data["sites"][0]["advice"] == "cannot tell"
  assert data["sites"][1]["suggestion"].startswith("none:")
  data["calibrated"]["share_of_step"] = 0.22
  data["sites"][0].update(suggestion="swap: decorate f", advice="swap")
  _calibrate.verdict(data)
  assert data["measured"]["disagrees"] is False
  assert data["measured"]["agrees"]["calibrated"] == "agrees"
  assert data["sites"][0]["suggestion"] == "swap: decorate f"
  # a measurement wider than the band cannot tell: never "agrees"
  data["measured"].update(measured_saving_interval=[-0.05, 0.5], summary="s")
  _calibrate.verdict(data)
  assert data["measured"]["agrees"]["calibrated"] == "cannot tell"
  assert "the measurement cannot tell (±27.5 points)" in (
      data["measured"]["summary"])
  assert "agrees" not in data["measured"]["summary"]


# -- the report ---------------------------------------------------------------------

@pytest.mark.parametrize("x,want", [(-8.47e-16, "0 s"), (0.0, "0 s"),
                                    (2.5e-6, "2.5 µs"), (0.0123, "12.3 ms"),
                                    (1.5, "1.5 s"), (3e-9, "3 ns")])
def test_seconds_text(x, want):
  assert _report.seconds_text(x) == want


def test_html_without_matplotlib(monkeypatch):
  step, args = _scanned(_sin_site(), True, n=2)
  report = smartvjp.audit(step, *args, configs=("as_written", "smartvjp"))
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  page = report.to_html()
  assert "pip install matplotlib" in page and "smartvjp[bench]" in page
  assert "<table>" in page


def test_one_name_and_one_colour_per_configuration():
  assert _report._SHORT["smartvjp_fused"] == "smartvjp_fused"
  assert set(smartvjp.audit.CONFIGS) <= set(_report.COLOURS)
  assert len(set(_report.COLOURS.values())) == len(_report.COLOURS)


def test_plots_show_every_configuration_at_one_point(monkeypatch):
  # four configurations at one point: each drawn hollow, its own marker,
  # size and colour, so none hides another; the legend names each once
  pytest.importorskip("matplotlib")
  import matplotlib.pyplot as plt
  step, args = _scanned(_sin_site(), False, n=2)
  report = smartvjp.audit(step, *args)
  drawn = []
  real = plt.Axes.scatter

  def scatter(ax, *a, **k):
    drawn.append(k)
    return real(ax, *a, **k)
  monkeypatch.setattr(plt.Axes, "scatter", scatter)
  titles = [t for t, _ in _report.plots(report.data)]
  assert len(titles) == 2
  configs = report.data["configs"]
  assert len(drawn) == len(configs) == 4
  assert len({k["s"] for k in drawn}) == 4
  assert len({k["marker"] for k in drawn}) == 4
  assert all(k["facecolors"] == "none" for k in drawn)
  assert [k["edgecolors"] for k in drawn] == [_report.COLOURS[c]
                                              for c in configs]
  assert [k["label"] for k in drawn] == [_report._SHORT[c] for c in configs]


# -- the command line ----------------------------------------------------------------

SCRIPT = '''
import jax, jax.numpy as jnp

@jax.custom_vjp
def bump(x):
  return jnp.sin(x)
bump.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))

def step(x=jnp.ones(4)):
  return jax.grad(lambda x: jnp.sum(jax.checkpoint(bump)(x)))(x)
'''


def _cli(*argv, cwd):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, "-m", "smartvjp.audit", *argv],
                        cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=300)


def test_cli(tmp_path):
  (tmp_path / "train.py").write_text(SCRIPT)
  out = _cli("train.py:step", "--json", "a.json", cwd=tmp_path)
  assert out.returncode == 0, out.stderr
  assert "__smartvjp_audit__" not in out.stdout
  assert "train.bump" in out.stdout
  assert "no step_args" in out.stderr and "--args" in out.stderr
  data = json.loads((tmp_path / "a.json").read_text())
  site = data["sites"][0]
  assert site["name"] == "train.bump"
  for where in [site["defined_at"], *site["called_at"]]:
    assert os.path.isabs(where.rsplit(":", 1)[0]), where
  assert str(tmp_path / "a.json") in out.stdout
  calibrated = _cli("train.py:step", "--calibrate", "--timing-budget",
                    "0.2", cwd=tmp_path)
  assert calibrated.returncode == 0, calibrated.stderr
  assert "(its rules timed)" in calibrated.stdout
  assert "budget 0.2 s" in calibrated.stdout
  missing = _cli("nowhere.py:step", cwd=tmp_path)
  assert missing.returncode == 2
  assert "Traceback" not in missing.stderr
  assert "no script at" in missing.stderr


# -- the JSON schema (docs/audit.md's tables) -----------------------------------------

def _schema_tables():
  """docs/audit.md's two key tables: ``{key: the row's value text}`` for
  the top level and for each site."""
  text = open(os.path.join(ROOT, "docs", "audit.md"), encoding="utf-8").read()
  section = text.split("## The JSON report", 1)[1].split("\n## ", 1)[0]
  top, site = section.split("Each site:", 1)

  def rows(part):
    out = {}
    for line in part.splitlines():
      cells = line.split("|")
      if len(cells) < 4 or cells[1].strip() in ("key", "---"):
        continue
      for key in cells[1].split("`")[1::2]:
        out[key] = cells[2]
    return out
  return rows(top), rows(site)


# objects whose keys are fixed (the others are keyed by configuration,
# role or rule)
NESTED_TOP = ("predicted", "measured", "summary", "calibrated", "model")
NESTED_SITE = ("predicted",)


def test_the_emitted_json_has_only_documented_keys():
  step, args = _scanned(_callback_pair(0.0), True, n=2)
  report = smartvjp.audit(step, *args, measure=True, timing_budget=1.0)
  data = json.loads(report.to_json())
  top, site = _schema_tables()
  extra = sorted(set(data) - set(top))
  for key in NESTED_TOP:
    assert key in data, key
    extra += [f"{key}.{k}" for k in data[key] if f"`{k}`" not in top[key]]
  for s in data["sites"]:
    extra += [f"sites[].{k}" for k in s if k not in site]
    for key in NESTED_SITE:
      extra += [f"sites[].{key}.{k}" for k in s[key]
                if f"`{k}`" not in site[key]]
    extra += [f"sites[].predicted.calibrated.{k}"
              for k in s["predicted"]["calibrated"]
              if f"`{k}`" not in site["predicted"]]
  assert not extra, f"keys emitted but not in docs/audit.md's schema: {extra}"


def _jit_in_fwd_site():
  """A rule whose ``fwd`` calls a ``jax.jit`` function holding its kernel
  under ``lax.cond``: JAX's lazy trace of that ``fwd`` under ``scan``
  stages an empty ``jit`` equation at the top level of the step."""
  def host(x):
    return np.asarray(np.exp(x), x.dtype)

  @jax.jit
  def inner(x):
    kernel = lambda x: jax.pure_callback(
        host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jax.lax.cond(jnp.sum(x) > -1e30, kernel, jnp.exp, x)

  @jax.custom_vjp
  def ex(x):
    return jnp.exp(x)
  ex.defvjp(lambda x: (inner(x), inner(x)), lambda y, g: (g * y,))
  return ex


def test_an_empty_staged_jit_is_neither_a_run_nor_the_sites_place():
  # a new user's step: jaxpr fwd 7 where 6 run, and "×1 per step" for a
  # site called once in each of 3 scanned layers
  step, args = _scanned(_jit_in_fwd_site(), True, n=3)
  report = smartvjp.audit(step, *args, configs=("as_written", "smartvjp"))
  site = report.sites[0]
  assert site["runs"]["as_written"]["jaxpr"]["fwd"] == 6
  assert site["runs"]["as_written"]["compiled"]["fwd"] == 6
  assert site["multiplicity"] == 3


def test_a_timed_saving_and_its_interval_from_paired_rounds():
  # f and fwd run one kernel alike: 6 runs of f for 6 of fwd; each round's
  # saving is 6 x (fwd - f) of that round, and the share is of the step
  info = dict(opaque=True, best_config="smartvjp", runs={
      "as_written": {"jaxpr": dict(f=0, fwd=6, bwd=3, fwd_bwd=0)},
      "smartvjp": {"jaxpr": dict(f=6, fwd=0, bwd=3, fwd_bwd=0)}})
  rng = np.random.default_rng(0)
  load = 1 + rng.random(30)            # each round's load, shared
  samples = {"f": list(380e-6 * load), "fwd": list(382e-6 * load),
             "bwd": list(4e-6 * load)}
  timed = {r: dict(seconds=float(np.median(v))) for r, v in samples.items()}
  step = list(10e-3 * load)
  est = _calibrate.site_estimate(info, timed, samples, step)
  assert _calibrate.coefficients(info, ["f", "fwd", "bwd"]) == {
      "f": -6.0, "fwd": 6.0, "bwd": 0.0}
  assert est["seconds_saved"] == pytest.approx(
      12e-6 * np.median(load), rel=1e-6)
  lo, hi = est["seconds_saved_interval"]
  assert lo <= est["seconds_saved"] <= hi
  # paired with the step per round: the load cancels
  assert est["share_of_step"] == pytest.approx(12e-6 / 10e-3, rel=0.3)
  lo, hi = est["share_of_step_interval"]
  assert lo <= est["share_of_step"] <= hi and hi - lo < 0.002
  assert est["rounds"] == 30 and est["level"] >= 0.95
  kind = _calibrate.site_advice(dict(info, predicted=dict(calibrated=est)))
  assert kind.kind == "no action"      # 0.1% of the step, surely


def test_the_html_table_leads_with_the_timed_saving():
  assert _report._saving_cell(dict(share_of_step=0.244)) == "+24.4%"
  assert _report._saving_cell(dict(
      share_of_step=0.244, calibrated=dict(share_of_step=0.215))) == (
          "+21.5% timed; +24.4% model")
  assert _report._saving_cell(dict(
      share_of_step=0.244, calibrated=dict(
          share_of_step=0.215, share_of_step_interval=[0.18, 0.25]))) == (
          "+21.5% (+18.0% to +25.0%) timed; +24.4% model")
