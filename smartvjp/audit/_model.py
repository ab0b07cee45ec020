"""The audit's time model: a step's (or a rule's) predicted seconds from its
cost, on a machine described by its peaks. Pure functions of plain data.

A roofline (S. Williams, A. Waterman, D. Patterson, "Roofline: an insightful
visual performance model for multicore architectures", CACM 52(4), 2009)
bounds one kernel's time below by ``max(flops / peak flop rate, bytes /
peak bandwidth)``. A whole step is many kernels, each bound by one of the
two, and XLA's ``cost_analysis`` gives only the step's totals. From totals,
``max(sum of compute, sum of memory)`` is a lower bound of the kernels'
summed rooflines and ``sum of compute + sum of memory`` an upper bound. The
audit uses the sum (``MODEL``): it keeps a change in either resource
visible, where the max hides every saving in the resource that does not
bind the step as a whole (a fused rule that saves memory traffic in a step
whose matmuls dominate its flops). Each kernel launch adds a fixed overhead
(the launch, and the copies and synchronisation around a custom call that
XLA cannot fuse across).
"""

from __future__ import annotations

import numbers

MODEL = ("roofline-sum: seconds = (flops + transcendentals) / peak flop rate"
         " + bytes accessed / peak bandwidth + kernel launches x launch "
         "overhead (Williams et al. 2009, summed over compute and memory)")

# peak dense flop rate (FLOP/s, bf16 on TPUs), peak memory bandwidth (B/s,
# HBM on TPUs) and seconds per kernel launch, per device kind as
# jax.Device.device_kind names it. TPU figures: Google Cloud's published
# peaks per chip. The CPU figures are an order of magnitude for a few cores
# of one socket (a ratio of two steps on one machine depends on the ratio
# of the first two, not on their scale).
PEAKS = {
    "TPU v4": dict(flops=275e12, bytes=1228e9, launch=2e-6),
    "TPU v5 lite": dict(flops=197e12, bytes=819e9, launch=2e-6),    # v5e
    "TPU v5e": dict(flops=197e12, bytes=819e9, launch=2e-6),
    "TPU v5": dict(flops=459e12, bytes=2765e9, launch=2e-6),        # v5p
    "TPU v5p": dict(flops=459e12, bytes=2765e9, launch=2e-6),
    "TPU v6 lite": dict(flops=918e12, bytes=1640e9, launch=2e-6),   # v6e
    # datasheet (H200 SXM: bf16 dense 989 TFLOP/s, HBM3e 4.8 TB/s), not
    # measured: to be replaced by a GPU session's own numbers, which
    # tools/gpu_session.py measures and passes as peaks=
    "NVIDIA H200": dict(flops=989e12, bytes=4.8e12, launch=4e-6),
    "cpu": dict(flops=1e11, bytes=2e10, launch=1e-5),
}
KEYS = ("flops", "bytes", "launch")


def peaks_for(device_kind: str, platform: str,
              override: dict | None = None) -> tuple[dict | None, str]:
  """``(peaks, where they came from)`` for a device: the table's entry for
  ``device_kind`` (else ``platform``'s, for ``"cpu"``), with ``override``'s
  keys replacing it; ``(None, why)`` when neither gives all three. Raises
  ``TypeError`` where ``override`` is not a dict, ``ValueError`` where it
  has another key or a value that is not a positive number."""
  base = PEAKS.get(device_kind) or PEAKS.get(platform)
  source = (f"table ({device_kind})" if device_kind in PEAKS else
            f"table ({platform})" if platform in PEAKS else None)
  if override is not None and not isinstance(override, dict):
    raise TypeError(f"smartvjp.audit: peaks must be a dict with any of "
                    f"{KEYS}, got {override!r} ({type(override).__name__})")
  if override:
    unknown = set(override) - set(KEYS)
    if unknown:
      raise ValueError(f"smartvjp.audit: peaks has unknown key(s) "
                       f"{sorted(unknown)}; its keys are {KEYS} (FLOP/s, "
                       "bytes/s, seconds per kernel launch)")
    for k, v in override.items():
      if (isinstance(v, bool) or not isinstance(v, numbers.Real)
          or not 0 < v < float("inf")):
        raise ValueError(f"smartvjp.audit: peaks[{k!r}] must be a positive "
                         f"number, got {v!r}")
    merged = dict(base or {}, **{k: float(v) for k, v in override.items()})
    if all(k in merged for k in KEYS):
      return merged, ("argument" if base is None
                      else f"{source}, with {sorted(override)} from the argument")
    base = None
  if base is None:
    return None, (f"no peaks for device kind {device_kind!r} ({platform}): "
                  "pass peaks={'flops': FLOP/s, 'bytes': B/s, 'launch': s}")
  return dict(base), source


def seconds(cost: dict, launches: int | float | None, peaks: dict) -> dict:
  """Predicted seconds of work of ``cost`` (``flops``, ``transcendentals``,
  ``bytes_accessed``; missing keys count 0) with ``launches`` kernel
  launches: ``{"compute", "memory", "launch", "total"}``."""
  compute = (cost.get("flops", 0.0) + cost.get("transcendentals", 0.0)) \
      / peaks["flops"]
  memory = cost.get("bytes_accessed", 0.0) / peaks["bytes"]
  launch = (launches or 0) * peaks["launch"]
  return dict(compute=compute, memory=memory, launch=launch,
              total=compute + memory + launch)


def ratio(candidate: dict | None, baseline: dict | None) -> float | None:
  """``candidate["total"] / baseline["total"]`` (``None`` without a time)."""
  if not candidate or not baseline or not baseline["total"]:
    return None
  return candidate["total"] / baseline["total"]


def site_seconds(runs: dict, rule_seconds: dict, opaque: bool,
                 launches: int | float, peaks: dict) -> float:
  """A site's predicted seconds per step in one configuration: each rule's
  runs (``{"f", "fwd", "bwd", "fwd_bwd"}``, per step) times its own
  seconds (``rule_seconds[role]``, launches excluded), plus ``launches``
  kernel launches. For a JAX-coded site, the runs of ``fwd`` beyond those
  of ``bwd`` (a ``fwd`` whose residuals nothing reads: the forward pass's,
  under remat) are priced as ``f``: XLA removes the work that only the
  residuals need. An opaque ``fwd`` runs whole."""
  total = 0.0
  for role, n in runs.items():
    total += n * rule_seconds.get(role, 0.0)
  if not opaque:
    extra = max(runs.get("fwd", 0) - runs.get("bwd", 0), 0)
    fwd = rule_seconds.get("fwd", 0.0)
    total -= extra * (fwd - rule_seconds.get("f", fwd))
  return total + launches * peaks["launch"]
