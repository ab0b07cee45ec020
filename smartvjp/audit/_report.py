"""The audit's report forms: the terminal table and the HTML page."""

from __future__ import annotations

import base64
import html as _html
import io

_SHORT = {"as_written": "jax.custom_vjp", "optimize_remat": "optimize_remat",
          "smartvjp": "smartvjp", "smartvjp_fused": "smartvjp_fused",
          "as_is": "as is"}


def runs_text(runs: dict | None, where: str = "compiled",
              no_work=()) -> str:
  """A site's runs per step under one configuration (``f 4 fwd 8``), the
  jaxpr's in brackets where they differ; a rule in ``no_work`` (it does
  no operations, so no count can see it) as ``f no work``."""
  if runs is None:
    return "—"
  counts = runs.get(where, runs.get("jaxpr"))
  idle = [r for r in no_work if not counts.get(r)]
  text = "; ".join(x for x in (
      " ".join(f"{r} {n}" for r, n in counts.items() if n),
      f"{', '.join(idle)} no work" if idle else "") if x) or "none"
  if where == "compiled" and runs.get("jaxpr") != counts:
    jaxpr = " ".join(f"{r} {n}" for r, n in runs["jaxpr"].items() if n)
    text += f" (jaxpr: {jaxpr or 'none'})"
  return text


def human_bytes(n) -> str:
  if n is None:
    return "—"
  n = float(n)
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} GiB"


def _signed(n, fmt=human_bytes) -> str:
  if n is None:
    return "—"
  return ("+" if n > 0 else "") + fmt(n) if n else "0"


def table(data: dict) -> str:
  lines = [f"smartvjp.audit of {data['function']} (jax {data['jax_version']}, "
           f"{data['backend']}; runs per step, compiled)"]
  for s in data["sites"]:
    lines += ["", *_site_lines(s, data["configs"])]
  return "\n".join(lines + ["", "step:", *_step_lines(data)])


def _site_lines(s: dict, configs) -> list[str]:
  lines = [f"[{s['index']}] {s['name']}  ({s['kind']}, "
           f"{'opaque' if s['opaque'] else 'JAX-coded'})",
           f"    defined at {s['defined_at']}"]
  for c in dict.fromkeys(s["called_at"]):
    lines.append(f"    called at  {c}")
  lines.append(f"    path {s['path']}  ×{s['multiplicity']} per step"
               + (f", policy {s['policy']}" if s["policy"] else ""))
  for c in configs:
    rb = s["residual_bytes"].get(c, {})
    lines.append(f"    {_SHORT.get(c, c):17} {runs_text(s['runs'].get(c), no_work=s.get('no_work', ())):40}"
                 f" residuals written {human_bytes(rb.get('written'))},"
                 f" dropped {human_bytes(rb.get('dropped'))}")
  for leaf in s["residuals"]:
    fates = ", ".join(f"{_SHORT.get(c, c)}: {f}"
                      for c, f in leaf["fate"].items())
    lines.append(f"    residual {leaf['path']} {leaf['dtype']}{leaf['shape']}"
                 f" {human_bytes(leaf['bytes'])}"
                 + (f" name={leaf['name']!r}" if leaf["name"] else "")
                 + f" ({fates})")
  cal = s["predicted"].get("calibrated")
  if cal and cal.get("seconds_saved") is not None:
    lines.append(f"    predicted saving {seconds_text(cal['seconds_saved'])}"
                 " per step" + _of_step(cal.get("share_of_step"),
                                        cal.get("share_of_step_interval"))
                 + " (its rules timed)")
  saved = s["predicted"].get("seconds_saved")
  if s["predicted"].get("unpriced"):
    lines.append("    model saving: —, unpriced: calibrate=True times it ("
                 + "; ".join(f"{r}: {', '.join(k)}" for r, k in
                             s["predicted"]["unpriced"].items())
                 + ": kernels whose cost XLA cannot see)")
  elif saved is not None:
    lines.append(f"    {'model' if cal else 'predicted'} saving "
                 f"{seconds_text(saved)} per step"
                 + _of_step(s["predicted"].get("share_of_step"))
                 + " (roofline of its rules' own costs)")
  opp = s.get("fwd_bwd_opportunity")
  if opp:
    lines.append(f"    fwd_bwd opportunity: fwd then bwd {opp['runs']}x "
                 "per step in the backward region; fused, "
                 f"{human_bytes(opp['residual_bytes_not_written'])} of "
                 f"residuals not written, {opp['launches_not_made']} "
                 "kernel launches not made")
  if s.get("measured"):
    lines.append("    measured: " + measured_text(s["measured"]))
  lines.append(f"    suggestion: {s['suggestion']}")
  for h in s["hazards"]:
    lines.append(f"    hazard: {h}")
  return lines


def _step_lines(data: dict) -> list[str]:
  lines, p = [], data.get("predicted") or {}
  for c in data["configs"]:
    st = data["step"][c]
    lines.append(f"    {_SHORT.get(c, c):17} peak {human_bytes(st['memory'].get('peak'))}"
                 f", temp {human_bytes(st['memory'].get('temp'))}"
                 f", flops {st['cost'].get('flops', 0):.3g}"
                 f", bytes accessed {st['cost'].get('bytes_accessed', 0):.3g}"
                 f", kernel launches {st['kernel_launches']}")
  if p:
    lines.append(f"    predicted ({_SHORT[p['candidate']]} vs jax.custom_vjp):"
                 f" peak {_signed(p['memory'].get('peak'))},"
                 f" temp {_signed(p['memory'].get('temp'))},"
                 f" flops x{_ratio(p['flops_ratio'])},"
                 f" bytes accessed x{_ratio(p['bytes_accessed_ratio'])},"
                 f" {p['launches_saved']} kernel launches fewer;"
                 f" time x{_ratio(p.get('predicted_ratio'))} (roofline"
                 + (f"; partial: it cannot price {', '.join(p['unpriced_kernels'] or ['some kernels'])}"
                    f"{' in ' + ', '.join(p['unpriced_sites']) if p.get('unpriced_sites') else ''}"
                    if p.get("partial") else "") + ")")
  st = data.get("step_time")
  cal = data.get("calibrated")
  if st:
    lines.append(f"    as written, timed: {seconds_text(st['median'])} per step"
                 f" (95% interval {seconds_text(st['low'])} to "
                 f"{seconds_text(st['high'])}, {st['samples']} rounds"
                 + (f", {st['loop']} runs a sample" if st["loop"] > 1 else "")
                 + (f"; on {cal['inputs']})" if cal else ")"))
  if cal and cal.get("share_of_step") is not None:
    lines.append("    timed: the swap saves "
                 + _of_step(cal["share_of_step"],
                            cal.get("share_of_step_interval"))[2:-1]
                 + f" (timing stopped: {cal['stopped']}, budget "
                 f"{cal['budget_s']:g} s)")
  m = data.get("measured")
  if m:
    lines.append(f"    measured: {m['summary']}")
  for c, e in data["errors"].items():
    lines.append(f"    measure=True: {e}" if c == "measure" else
                 f"    {_SHORT.get(c, c)} did not trace: {e}")
  lines.append(f"    audit took {cost_text(data)}")
  return lines


def cost_text(data: dict) -> str:
  """What the audit took, all of it, with its parts (``audit_cost``)."""
  c = data.get("audit_cost")
  ratio = f"{data['audit_cost_in_compiles']:.1f}x one trace+compile"
  if not c:
    return f"{data['audit_seconds']:.2f} s ({ratio})"
  parts = [f"trace and compile {c['trace_compile_s']:.2f} s"]
  if c.get("rule_timing_s"):
    parts.append(f"rule and step timing {c['rule_timing_s']:.2f} s")
  if c.get("measure_s"):
    parts.append(f"A/B {c['measure_s']:.2f} s")
  return f"{c['total_s']:.2f} s ({', '.join(parts)}; {ratio})"


def measured_text(m: dict) -> str:
  """A site's ``measured`` (``measure=True``) in one line."""
  if "error" in m:
    return f"not measured: the step with it swapped failed: {m['error']}"
  lo, hi = m["interval"]
  return (f"{m['saving']:.1%} of the step saved (95% interval {lo:.1%} to "
          f"{hi:.1%}, {m['rounds']} rounds, {m['stopped']})")


def seconds_text(x: float) -> str:
  """Seconds for people: ``0 s`` below a nanosecond (a difference of two
  equal sums can print as -8.47e-16), else in s, ms or µs."""
  if abs(x) < 1e-9:
    return "0 s"
  for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
    if abs(x) >= scale:
      return f"{x / scale:.3g} {unit}"
  return f"{x * 1e9:.3g} ns"


def _of_step(share, interval=None) -> str:
  if share is None:
    return ""
  text = f"{0.0 if abs(share) < 5e-4 else share:.1%} of the step"
  if interval:
    text += f", 95% interval {interval[0]:+.1%} to {interval[1]:+.1%}"
  return f" ({text})"


def _share(r) -> str:
  return "—" if r is None else f"{r:+.1%}"


def _saving_cell(predicted: dict) -> str:
  """The HTML table's saving: the rules' timed estimate first where there
  is one (as the text table leads with it), then the time model's."""
  model = _share(predicted.get("share_of_step"))
  timed = predicted.get("calibrated") or {}
  cal, iv = timed.get("share_of_step"), timed.get("share_of_step_interval")
  if cal is None:
    return model
  within = f" ({_share(iv[0])} to {_share(iv[1])})" if iv else ""
  return f"{_share(cal)}{within} timed; {model} model"


def _ratio(r) -> str:
  return "—" if r is None else f"{r:.3f}"


# -- the HTML page -----------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:80em;color:#222}
table{border-collapse:collapse;font-size:85%;width:100%}td,th{border:1px solid #ccc;
padding:.25em .5em;vertical-align:top;overflow-wrap:normal;word-break:normal}
th{background:#f3f3f3}
pre{white-space:pre-wrap}
code{font-size:90%}.warn{color:#a40}details{margin:.3em 0}
.plots img{max-width:48%;margin-right:1%}
"""


# one colour and marker per configuration, on every page
COLOURS = {"as_written": "#1f77b4", "optimize_remat": "#ff7f0e",
           "smartvjp": "#2ca02c", "smartvjp_fused": "#d62728",
           "as_is": "#7f7f7f"}
MARKERS = ("o", "s", "D", "^", "v")

MISSING_MATPLOTLIB = (
    "the plots need matplotlib, which is not installed: pip install "
    "matplotlib (or smartvjp's bench extra: pip install \"smartvjp[bench]\")")


def _figure_svg(fig) -> str:
  buf = io.BytesIO()
  fig.savefig(buf, format="svg", bbox_inches="tight")
  return ("data:image/svg+xml;base64,"
          + base64.b64encode(buf.getvalue()).decode("ascii"))


def plots(data: dict) -> list[tuple[str, str]]:
  """``[(title, data URL of an SVG)]``: residual bytes per site and
  configuration, and step memory against step time (measured, else the
  time model's prediction)."""
  import matplotlib   # optional dependency: only the HTML page's plots
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  configs = data["configs"]
  sites = data["sites"]
  out = []
  fig, ax = plt.subplots(figsize=(6.4, 3.2))
  width = 0.8 / max(len(configs), 1)
  for i, c in enumerate(configs):
    xs = [j + i * width for j in range(len(sites))]
    ax.bar(xs, [s["residual_bytes"].get(c, {}).get("written", 0) for s in sites],
           width, label=f"{_SHORT.get(c, c)} written", color=COLOURS.get(c))
    ax.bar(xs, [s["residual_bytes"].get(c, {}).get("dropped", 0) for s in sites],
           width, fill=False, hatch="//", edgecolor="k")
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sites))])
  ax.set_xticklabels([f"[{s['index']}] {s['name'][-24:]}" for s in sites],
                     rotation=15, fontsize=7)
  ax.set_ylabel("residual bytes per step")
  ax.set_title("Residual bytes per site (hatched: written, then dropped)")
  ax.legend(fontsize=9)
  out.append(("Residual bytes per site", _figure_svg(fig)))
  plt.close(fig)
  fig, ax = plt.subplots(figsize=(6.4, 3.2))
  measured = data.get("measured") or {}
  timed = measured.get("seconds", {})
  # measured: the timed configurations by median step time; else every
  # configuration by the time model's seconds
  for i, c in enumerate(list(timed) if timed else configs):
    st = data["step"][c]
    x = timed[c]["median"] * 1e3 if timed else (
        st.get("predicted_seconds") or {}).get("total", 0) * 1e3
    # each configuration its own colour (the same on every page) and marker,
    # hollow and of decreasing size, so that points at one place all show
    ax.scatter([x], [st["memory"].get("peak", 0)], s=160 - 30 * i,
               marker=MARKERS[i % len(MARKERS)], facecolors="none",
               edgecolors=COLOURS.get(c, "k"), linewidths=1.8,
               label=_SHORT.get(c, c))
    if timed:
      ax.errorbar([x], [st["memory"].get("peak", 0)], fmt="none",
                  xerr=[[x - timed[c]["min"] * 1e3],
                        [timed[c]["max"] * 1e3 - x]], ecolor="gray")
  ax.set_xlabel("step time, median and min-max (ms)" if timed
                else "predicted step time (ms, the audit's time model)")
  ax.set_ylabel("peak memory (bytes)")
  ax.set_title("Step memory against step cost, per configuration")
  ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  out.append(("Step memory and cost", _figure_svg(fig)))
  plt.close(fig)
  return out


def _breakable(text: str) -> str:
  """``text`` escaped for HTML, with a line-break opportunity (``<wbr>``)
  after each ``.``, ``/`` and ``›``: a long qualified name or path wraps
  between its parts, never inside a word."""
  out = _html.escape(text)
  for sep in (".", "/", "›"):
    out = out.replace(sep, sep + "<wbr>")
  return out


def html(data: dict) -> str:
  e = _html.escape
  configs = data["configs"]
  rows = []
  for s in data["sites"]:
    cells = "".join(f"<td>{e(runs_text(s['runs'].get(c), no_work=s.get('no_work', ())))}</td>"
                    for c in configs)
    rows.append(
        f"<tr><td>{s['index']}</td><td><code>{_breakable(s['name'])}</code>"
        f"</td><td>{'opaque' if s['opaque'] else 'JAX-coded'}</td>"
        f"<td>{_breakable(s['path'])} ×{s['multiplicity']}</td>{cells}"
        f"<td>{e(human_bytes(s['residual_bytes'].get('as_written', {}).get('dropped')))}"
        f"</td><td>{e(_saving_cell(s['predicted']))}</td>"
        f"<td>{e(s['suggestion'])}</td></tr>")
  details = []
  for s in data["sites"]:
    leaves = "".join(
        f"<tr><td><code>{e(leaf['path'])}</code></td><td>{e(leaf['dtype'])}"
        f"{leaf['shape']}</td><td>{e(human_bytes(leaf['bytes']))}</td>"
        f"<td>{e(str(leaf['name'] or ''))}</td><td>"
        + e(", ".join(f"{_SHORT.get(c, c)}: {f}" for c, f in leaf["fate"].items()))
        + "</td></tr>" for leaf in s["residuals"])
    hazards = "".join(f"<li class=warn>{e(h)}</li>" for h in s["hazards"])
    details.append(
        f"<details><summary>[{s['index']}] <code>{e(s['name'])}</code></summary>"
        f"<p>defined at <code>{e(s['defined_at'])}</code><br>called at "
        + ", ".join(f"<code>{e(c)}</code>" for c in dict.fromkeys(s["called_at"]))
        + f"<br>path {e(s['path'])}, policy {e(str(s['policy']))}</p>"
        f"<table><tr><th>residual</th><th>type</th><th>bytes</th><th>name</th>"
        f"<th>fate</th></tr>{leaves}</table>"
        + (f"<ul>{hazards}</ul>" if hazards else "") + "</details>")
  try:
    figs = "".join(f'<img alt="{e(t)}" src="{u}">' for t, u in plots(data))
  except ModuleNotFoundError as err:
    if err.name != "matplotlib" and not str(err.name).startswith("matplotlib."):
      raise
    figs = f"<p class=warn>{e(MISSING_MATPLOTLIB)}</p>"
  head = "".join(f"<th>{e(_SHORT.get(c, c))}</th>" for c in configs)
  summary = e(table(data).split("\nstep:\n", 1)[-1])
  return (
      "<!doctype html><html><head><meta charset=utf-8>"
      f"<title>smartvjp.audit: {e(data['function'])}</title>"
      f"<style>{_CSS}</style></head><body>"
      f"<h1>smartvjp.audit of <code>{e(data['function'])}</code></h1>"
      f"<p>jax {e(data['jax_version'])}, {e(data['backend'])}; schema "
      f"<code>{e(data['schema'])}</code>. Runs per step in the compiled "
      "program (the jaxpr's count in brackets where it differs).</p>"
      f"<table><tr><th>#</th><th>site</th><th>kind</th><th>path</th>{head}"
      f"<th>dropped (as written)</th><th>predicted saving (of the step)</th>"
      "<th>suggestion</th></tr>"
      + "".join(rows) + "</table>" + "".join(details)
      + f"<h2>Step</h2><pre>{summary}</pre><div class=plots>{figs}</div>"
      "</body></html>")
