"""``smartvjp.audit``: what the swap would change in your step, per custom_vjp site.

``smartvjp.audit(step, *args, **kwargs)`` traces and compiles ``step`` (it
runs nothing unless ``measure=True``) under four configurations of every
``jax.custom_vjp`` and ``smart_custom_vjp`` call it makes, in your code or a
library's, without changing that code:

* ``as_written``: each site as ``jax.custom_vjp`` with its rules;
* ``optimize_remat``: each as ``jax.custom_vjp`` with ``optimize_remat=True``;
* ``smartvjp``: each as ``smart_custom_vjp`` with ``fwd`` and ``bwd``;
* ``smartvjp_fused``: each as ``smart_custom_vjp`` with its ``fwd_bwd``
  where it has one (traced only when some site has one).

Per site it reports how often ``f``, ``fwd``, ``bwd`` and ``fwd_bwd`` run
per step under each, counted in the jaxpr and in the compiled program (by
the named scope the audit puts each rule under: a name in the metadata,
which changes nothing XLA keeps or removes); the residuals (shape, dtype,
bytes, name, and their fate: saved, written then dropped, recomputed); the
difference between the compiled steps (``memory_analysis``,
``cost_analysis``, kernel launches); a suggestion and hazards. With
``measure=True``, each site's saving measured in the step (the step run
with that site alone swapped against it as written), and
``report.apply(step)``: the step with only the advised sites swapped. Also a
context manager (``capture``), a CI assertion (``assert_no_duplicate_fwd``)
and a command line (``python -m smartvjp.audit script.py:function``).
The JSON schema is documented in ``docs/audit.md``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import time
import types
from typing import Any, Callable, Iterator

import jax

from smartvjp import _facade as jx
from smartvjp.audit import _analysis as _audit
from smartvjp.audit import _calibrate
from smartvjp.audit import _capture
from smartvjp.audit import _measure
from smartvjp.audit import _report as _audit_report
from smartvjp.audit import _trace as _audit_trace
from smartvjp.audit._analysis import AuditError, SCHEMA

__all__ = ["audit", "Audit", "AuditError", "assert_no_duplicate_fwd",
           "capture", "Capture", "SCHEMA"]

CONFIGS = _audit_trace.CONFIGS


class Audit:
  """The result of ``smartvjp.audit``: a report per custom_vjp site.

  Attributes:
    data: the whole report as plain data (``dict``/``list``/``str``/
      numbers), the JSON form; its keys are documented in ``docs/audit.md``
      (``schema`` names the version).
    sites: ``data["sites"]``, one ``dict`` per site, sorted by predicted
      saving (the time model's seconds saved, then kernel launches saved,
      then residual bytes no longer dropped).
    summary: ``data["summary"]``: totals per configuration.
    predicted: ``data["predicted"]``: the compiled step as written against
      the swapped one (differences of ``memory_analysis`` and
      ``cost_analysis``, kernel launches saved, the time model's
      ``predicted_ratio``).
    measured: ``data.get("measured")``: the timed A/B with ``measure=True``,
      else ``None``.

  ``apply(step)`` gives the step with the swap made only at the sites the
  report advises it for.
  """

  def __init__(self, data: dict, builds: dict | None = None):
    self.data = data
    self._builds = builds or {}

  sites = property(lambda self: self.data["sites"])
  summary = property(lambda self: self.data["summary"])
  predicted = property(lambda self: self.data["predicted"])
  measured = property(lambda self: self.data.get("measured"))

  def runs(self, config: str = "as_written", where: str = "compiled"
           ) -> dict[str, dict[str, int]]:
    """``{site name: {"f": n, "fwd": n, "bwd": n, "fwd_bwd": n}}``: runs per
    step under ``config``, counted ``where`` (``"compiled"`` or
    ``"jaxpr"``). Two sites with one name are keyed ``name#index``.

    Raises:
      KeyError: ``config`` was not traced (it failed: see
        ``data["errors"]``), or ``where`` is neither count.
    """
    if where not in ("compiled", "jaxpr"):
      raise KeyError(f"runs(where={where!r}): a count is read from "
                     "'compiled' (the compiled program) or 'jaxpr'")
    out = {}
    for s in self.sites:
      runs = s["runs"].get(config)
      if runs is None:
        raise KeyError(f"configuration {config!r} has no counts: "
                       f"{self.data['errors'].get(config, 'not traced')}")
      key = s["name"] if s["name"] not in out else f"{s['name']}#{s['index']}"
      out[key] = dict(runs[where])
    return out

  def apply(self, step: Callable) -> Callable:
    """``step`` with the swap made only at the sites whose ``advice`` is
    ``"swap"`` (their measured saving with ``measure=True``, else the
    estimate's; ``docs/audit.md``), each to its ``best_config``
    (``smart_custom_vjp``, with its ``fwd_bwd`` where it has one); every
    other custom_vjp call as written.

    Args:
      step: the audited step (or any function making the same custom_vjp
        calls: a site is the ``jax.custom_vjp`` object the audit found).

    Returns:
      A function of ``step``'s arguments returning what ``step`` returns
      (the same pytree, shapes and dtypes), traced through the audit's
      interception of custom_vjp calls (``_trace.recording``: it clears
      JAX's caches each time it traces). It can be called eagerly, under
      ``jax.jit`` or any transformation; where ``step`` is a ``jax.jit``
      function it is one too, with the same static arguments, so that it
      traces once per signature. A custom_vjp object the audit did not see
      (one made anew at each call) is left as written.

    Raises:
      ValueError: the report was not made in this process (read back from
        JSON: it holds no sites to swap), or a site advised "swap" cannot be
        swapped (refused, e.g. ``nondiff_argnums`` the swap does not take;
        its ``refused`` says why).
      TypeError: ``step`` is not callable.
    """
    if not callable(step):
      raise TypeError(f"Audit.apply: the step must be a function, got "
                      f"{step!r} ({type(step).__name__})")
    sites = next((b.sites for b in self._builds.values() if b.sites), None)
    if sites is None:
      raise ValueError("Audit.apply needs the report smartvjp.audit made in "
                       "this process (it holds the custom_vjp sites it "
                       "found); a report read back from JSON holds none")
    advised = [s for s in self.sites if (
        s.get("advice") or _calibrate.site_advice(s).kind) == "swap"]
    bad = [f"{s['name']} ({s['refused'] or s['kind']})" for s in advised
           if s["refused"] is not None or s["kind"] != "jax.custom_vjp"]
    if bad:
      raise ValueError("Audit.apply: the report advises a swap it cannot "
                       "make at: " + ", ".join(bad))
    config = _audit_trace.swapped(
        {s["index"]: s["best_config"] for s in advised}, rest="as_is")

    @functools.wraps(step)
    def applied(*args, **kwargs):
      with _audit_trace.recording(config, sites):
        return step(*args, **kwargs)
    if jx.is_jit_function(step):
      nums, names = jx.jit_static_arguments(step)
      return jax.jit(applied, static_argnums=nums, static_argnames=names)
    return applied

  def table(self) -> str:
    """The terminal table: one row per site, then the step's totals."""
    return _audit_report.table(self.data)

  def to_json(self, path: str | None = None) -> str:
    """The report as JSON text (written to ``path`` too, where given)."""
    text = json.dumps(self.data, indent=1, default=str)
    if path is not None:
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text

  def to_html(self, path: str | None = None) -> str:
    """One self-contained HTML page (site table, details, plots drawn by
    matplotlib and embedded as SVG); written to ``path`` too, where given.
    Without matplotlib the page says how to install it in place of the
    plots (``pip install matplotlib``, or the ``bench`` extra).
    """
    text = _audit_report.html(self.data)
    if path is not None:
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text

  def __str__(self):
    return self.table()

  def __repr__(self):
    return (f"<smartvjp Audit of {self.data['function']}: "
            f"{len(self.sites)} site(s)>")


def _name(fn) -> str:
  return getattr(fn, "__qualname__", None) or repr(fn)


def check_arguments(fn, args, kwargs, *, configs, measure, calibrate,
                    timing_budget=_calibrate.BUDGET_S) -> None:
  """Raises on arguments ``audit`` cannot take (see its ``Raises``)."""
  if not callable(fn):
    raise TypeError(f"smartvjp.audit: the step must be a function, got "
                    f"{fn!r} ({type(fn).__name__}); call smartvjp.audit(step,"
                    " *its_arguments)")
  for name, value in (("measure", measure), ("calibrate", calibrate)):
    if not isinstance(value, bool):
      raise TypeError(f"smartvjp.audit: {name} must be True or False, got "
                      f"{value!r} ({type(value).__name__})")
  if (isinstance(timing_budget, bool)
      or not isinstance(timing_budget, (int, float))
      or not math.isfinite(timing_budget) or timing_budget < 0):
    raise ValueError(f"smartvjp.audit: timing_budget must be a number of "
                     f"seconds >= 0, got {timing_budget!r}")
  if isinstance(configs, str) or not configs:
    raise ValueError(f"smartvjp.audit: configs must be a tuple of some of "
                     f"{CONFIGS}, got {configs!r}")
  unknown = set(configs) - set(CONFIGS)
  if unknown or configs[0] != "as_written":
    raise ValueError(
        f"smartvjp.audit: configs must be some of {CONFIGS} starting with "
        f"'as_written' (every saving is measured from it), got {configs!r}")
  dyn_args, dyn_kwargs = _measure.dynamic_arguments(fn, args, kwargs)
  leaves = jax.tree_util.tree_leaves_with_path((dyn_args, dyn_kwargs))
  for path, leaf in leaves:
    if isinstance(leaf, (str, bytes)):
      where = jax.tree_util.keystr(path[1:]) if path else ""
      raise TypeError(
          f"smartvjp.audit: the argument at {where or '?'} of "
          f"{_name(fn)} is a {type(leaf).__name__} ({leaf!r}); "
          "the audit traces its arguments as arrays and takes no "
          "static_argnums: bind it first, smartvjp.audit(functools."
          f"partial({_name(fn)}, ...), arrays...)")


def audit(fn: Callable, *args: Any, measure: bool = False,
          calibrate: bool = False,
          timing_budget: float = _calibrate.BUDGET_S,
          configs: tuple[str, ...] = CONFIGS,
          peaks: dict[str, float] | None = None, **kwargs: Any) -> Audit:
  """Audits every custom_vjp site of ``fn(*args, **kwargs)``.

  Args:
    fn: the step (any function ``jax.jit`` can trace, or a ``jax.jit``
      function; not one with donated arguments).
    *args: its positional arguments: arrays or ``jax.ShapeDtypeStruct``
      (pytrees of them), so a step too large for this machine can still be
      audited (nothing runs unless ``measure=True``).
    measure: also measure each site's saving in the step (``_measure``):
      the compiled step run on these arguments as written, with each site
      alone swapped, and with every site swapped, in interleaved paired
      rounds until each saving's 95% interval is inside the tolerance band
      (half-width at most ±25% of the saving or 1 point of the step,
      whichever is larger) or ``timing_budget`` runs out; per site
      ``site["measured"]`` (the saving, its interval), for the step
      ``measured`` (the all-swapped step's paired ratio and saving). A
      configuration that does not trace, compile or run is recorded with
      its error, not raised. ``ShapeDtypeStruct`` arguments are filled
      with made-up values (N(0, 1) floats, zero integers) and the report
      says so (``measured["inputs"]``).
    calibrate: also time each site's rules on this device, on the values
      the step gives them (captured from one more run of the step, as
      written, on these arguments; on made-up values of a realistic scale
      where they are ``jax.ShapeDtypeStruct``), each in a compiled loop of
      K runs, and the as-written step beside them (``data["step_time"]``),
      in interleaved rounds until each median's 95% interval is within
      ±5% or ``timing_budget`` runs out (``_capture``); predict each
      site's saving from its runs saved times those times, as a share of
      the measured step with its 95% interval (``predicted["calibrated"]``
      per site, ``calibrated`` for the step), reported before the time
      model's, and advise from that interval (``site["advice"]``).
      Implied by ``measure=True``, which then checks both estimates
      against the step's measured saving (within ±25% of it or 1 point of
      the step, whichever is larger; "cannot tell" where the
      measurement's own interval is wider).
    timing_budget: seconds of timing rounds for ``calibrate``, and as
      many again for ``measure`` (default ``_calibrate.BUDGET_S``, 10 s;
      a number >= 0), beside the capture's trace, compile and run, the
      loops' and the per-site steps' compiles and one warm-up run of each
      (``data["audit_cost"]`` says what each took); the first round always
      completes, and the rounds stop earlier where every interval is
      narrow enough.
    configs: the configurations to trace and compile, a subset of
      ``CONFIGS`` starting with ``"as_written"`` (fewer compiles: a cheaper
      audit).
    peaks: the time model's machine, overriding the table's entry for this
      device kind (``smartvjp.audit._model.PEAKS``; TPU v5e: 197e12 FLOP/s
      bf16, 819e9 B/s HBM): any of ``"flops"`` (FLOP/s), ``"bytes"``
      (bytes/s) and ``"launch"`` (seconds per kernel launch), floats. The
      model (a roofline, Williams et al. 2009, its compute and memory
      times summed, plus launches) gives ``predicted["predicted_ratio"]``
      and each site's ``predicted["seconds_saved"]``.
    **kwargs: its keyword arguments, as ``*args``.

  Returns:
    An ``Audit``; ``print(it)`` shows the table. Each site's ``advice``
    (``"swap"``, ``"no action"``, ``"cannot tell"``) follows its measured
    saving where measured, else the estimate; ``Audit.apply`` makes the
    advised swaps.

  Raises:
    AuditError: ``fn`` does not trace or compile under any configuration
      (the first error is quoted), makes no ``jax.custom_vjp`` or
      ``smart_custom_vjp`` call, or donates arguments.
    ValueError: ``configs`` names an unknown configuration or does not
      start with ``"as_written"``, ``timing_budget`` is not a number of
      seconds >= 0, or ``peaks`` has a key other than
      ``flops``, ``bytes``, ``launch`` or a value that is not a positive
      number.
    TypeError: ``fn`` is not callable, ``peaks`` is not a dict,
      ``measure`` or ``calibrate`` is not a bool, or an argument
      is a string (bind it with ``functools.partial``: the audit takes no
      ``static_argnums``).

  The audit clears JAX's caches (``jax.clear_caches()``) before and after
  each configuration, so that nothing traced with one is reused by another
  or by your program afterwards: functions jitted before it compile again.
  """
  start = time.perf_counter()
  check_arguments(fn, args, kwargs, configs=configs, measure=measure,
                  calibrate=calibrate, timing_budget=timing_budget)
  data, builds = _audit.analyse(fn, args, kwargs, tuple(configs), peaks)
  cost = dict(trace_compile_s=time.perf_counter() - start, rule_timing_s=0.0,
              measure_s=0.0)
  if measure:
    t = time.perf_counter()
    sites = next(iter(builds.values())).sites
    data["measured"] = _measure.measure(
        builds, data, args, kwargs, fn=fn,
        compile_configs=lambda cs: _audit.build_all(fn, args, kwargs, cs,
                                                     sites),
        budget_s=float(timing_budget))
    cost["measure_s"] = time.perf_counter() - t
  if calibrate or measure:
    t = time.perf_counter()
    concrete = _calibrate.made_up(_measure.dynamic_arguments(fn, args, kwargs))
    _capture.attach(data, builds, _audit.advise, fn, args, kwargs,
                    concrete, timing_budget)
    cost["rule_timing_s"] = time.perf_counter() - t
  if measure:   # the advice follows each site's measured saving
    for s in data["sites"]:
      s["advice"], s["suggestion"] = _audit.advise(s)
      s["suggestion"] = _measure.suggestion(s)
  data["audit_cost"] = dict(total_s=time.perf_counter() - start, **cost)
  return Audit(data, builds)


def assert_no_duplicate_fwd(fn: Callable, *args: Any,
                            include_jax_coded: bool = False,
                            **kwargs: Any) -> Audit:
  """Fails when a compiled ``fn`` runs an opaque ``fwd`` more often than
  its ``bwd`` (the forward pass's ``fwd`` dropped and run again under
  remat, jax-ml/jax#21303): for users' CI, in place of counting custom
  calls in HLO text.

  The program is audited as written (each site with the decorator it was
  made with), compiled only.

  Args:
    fn: the step, as for ``audit``.
    *args: its positional arguments, as for ``audit``.
    include_jax_coded: also check sites whose rules are plain JAX (XLA may
      already remove the dead work there; off by default).
    **kwargs: its keyword arguments, as for ``audit``.

  Returns:
    The ``Audit`` of the program as written (configuration ``as_is``).

  Raises:
    AssertionError: naming each offending site, its call site and counts.
    AuditError: as ``audit``.
  """
  data, builds = _audit.analyse(fn, args, kwargs, configs=("as_is",))
  bad = []
  for s in data["sites"]:
    runs = s["runs"]["as_is"]["compiled"]
    if (s["opaque"] or include_jax_coded) and runs["fwd"] > runs["bwd"]:
      bad.append(f"{s['name']} (called at {', '.join(s['called_at'])}): "
                 f"fwd runs {runs['fwd']}x, bwd {runs['bwd']}x per step "
                 f"({s['path']})")
  if bad:
    raise AssertionError(
        "fwd runs more often than bwd (its forward-pass run is dropped and "
        "recomputed) at:\n  " + "\n  ".join(bad)
        + "\nswap the site to smartvjp.smart_custom_vjp (see "
        "smartvjp.audit for what it changes)")
  return Audit(data, builds)


class Capture:
  """What ``capture()`` yields: ``watch`` a step; its first call is audited
  on the arguments it is given (then the step runs as usual).

  Attributes:
    audit: the ``Audit`` of the first watched call, or ``None`` before.
  """

  def __init__(self, measure: bool):
    self.audit: Audit | None = None
    self._measure = measure

  def watch(self, step: Callable) -> Callable:
    """``step`` unchanged, except that its first call is audited first."""
    def watched(*args, **kwargs):
      if self.audit is None:
        self.audit = audit(step, *args, measure=self._measure, **kwargs)
      return step(*args, **kwargs)
    watched.__wrapped__ = step
    return watched


@contextlib.contextmanager
def capture(*, measure: bool = False, show: bool = True) -> Iterator[Capture]:
  """A context manager around a training loop.

  ```python
  import jax, jax.numpy as jnp
  import smartvjp

  F = jax.custom_vjp(lambda x: jnp.sin(x))
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  step = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x))))

  with smartvjp.audit.capture(show=False) as cap:
    step = cap.watch(step)        # audited at its first call
    for _ in range(3):
      step(jnp.ones(3))
  assert cap.audit.sites[0]["runs"]["as_written"]["jaxpr"]["fwd"] == 2
  ```

  Args:
    measure: as for ``audit``.
    show: print the table when the block ends (if a step was audited).

  Yields:
    A ``Capture``.
  """
  cap = Capture(measure)
  yield cap
  if show and cap.audit is not None:
    print(cap.audit.table())


class _CallableModule(types.ModuleType):
  """``smartvjp.audit`` is this module and, called, ``audit``."""

  def __call__(self, fn, *args, **kwargs):
    return audit(fn, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
