"""Where the step time of ``accel_mlp.py``'s checkpointed stack goes, op by op.

``accel_mlp.py`` times each row's step and each rule's kernels alone; on a
TPU the kernel rows' steps run well above the sum of their kernels. This
script says where the rest goes: for each workload, hidden size and row it
compiles the same step (``accel_mlp.stack_grad``), runs it ``--steps`` times
under ``jax.profiler.trace`` and reads the trace with
``jax.profiler.ProfileData`` (no TensorBoard needed). Per row, per step:

* the device time of every executed HLO instruction (the ``XLA Ops`` line of
  the device plane), joined with the optimized HLO (``compiled.as_text()``)
  for its opcode, fusion kind, custom-call target and the JAX ``op_name``
  that made it;
* totals by class: Pallas kernels (``tpu_custom_call``, by kernel name),
  fusions that contain a convolution/dot (XLA's matmuls), other fusions,
  copies and transposes, control, and the rest;
* the busy time (sum of the ops) beside the wall time of a step, and the
  top ``--top`` instructions. A ``while``, ``conditional`` or ``call`` event
  spans the ops it runs, so it is reported apart (``loops_ms``), not added
  to the busy time.

It also writes each row's optimized HLO, gzipped, beside the JSON, so the
programs can be read off the chip.

    python benchmarks/accel_profile.py --out $OUT/accel_profile.json
    python benchmarks/accel_profile.py --smoke      # CPU, tiny shapes

Nothing here is a performance claim: the figures explain ``accel_mlp.py``'s.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import accel_mlp as A  # noqa: E402  (puts examples/ and the checkout on the path)
import _report as R  # noqa: E402

SCHEMA = "smartvjp/accel_profile/1"

# an instruction line of HLO text: "%name = type opcode(operands), attrs"
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s"
                    r"([a-z][\w\-]*)\((.*)$")
_ATTR = {
    "kind": re.compile(r"\bkind=(k\w+)"),
    "target": re.compile(r'custom_call_target="([^"]+)"'),
    "op_name": re.compile(r'op_name="([^"]+)"'),
    "calls": re.compile(r"\bcalls=%?([\w.\-]+)"),
    "kernel": re.compile(r'kernel_name\W{1,6}([\w.\-]+)'),
}


def hlo_index(text):
  """``{instruction name: {opcode, kind, target, op_name, kernel, has_dot}}``
  from optimized HLO text; ``has_dot`` says a fusion's computation holds a
  ``dot`` or ``convolution``."""
  comps, current, instrs = {}, None, {}
  for line in text.splitlines():
    head = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and "=" not in line.split("{")[0]:
      current = head.group(1)
      comps[current] = []
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, _, opcode, rest = m.groups()
    info = dict(opcode=opcode, computation=current)
    for key, rx in _ATTR.items():
      found = rx.search(rest)
      if found:
        info[key] = found.group(1)
    instrs[name] = info
    if current is not None:
      comps[current].append(opcode)
  for info in instrs.values():
    body = comps.get(info.get("calls"), ())
    info["has_dot"] = any(op in ("dot", "convolution") for op in body)
  return instrs


# an event of the device's "XLA Ops" line is named by the instruction's whole
# HLO text ("%fusion.3 = bf16[...] fusion(...)") on a TPU, by its name
# elsewhere
_EVENT_NAME = re.compile(r"^%?([\w.\-]+)")
# instructions whose events contain the events of the ops they run
CONTAINERS = ("while", "conditional", "call")


def event_instruction(event_name):
  """The HLO instruction name an ``XLA Ops`` event stands for."""
  m = _EVENT_NAME.match(event_name)
  return m.group(1) if m else event_name


def op_class(info):
  """The class an executed instruction's time is charged to."""
  if info is None:
    return "unknown"
  op = info["opcode"]
  if op == "custom-call":
    return ("kernel " + info.get("kernel", "?")
            if info.get("target") == "tpu_custom_call"
            else "custom-call " + info.get("target", "?"))
  if op == "fusion":
    if info.get("has_dot"):
      return "fusion with dot (XLA matmul)"
    return f"fusion {info.get('kind', '?')}"
  if op in ("copy", "transpose", "copy-start", "copy-done"):
    return "copy/transpose"
  if op in ("dot", "convolution"):
    return "dot (XLA matmul)"
  if op in CONTAINERS + ("parameter", "get-tuple-element", "tuple",
                        "constant", "bitcast"):
    return "control"
  return op


def device_ops(pdata):
  """``([(name, duration_ns)], {plane: [line names]})``: the executed HLO
  instructions on the first device (the ``XLA Ops`` line of
  ``/device:*:0``; on a CPU, with no device plane, the host's events as they
  are), and every plane's lines."""
  planes = list(pdata.planes)
  dev = [p for p in planes if re.match(r"/device:(TPU|GPU):0\b", p.name)]
  lines = []
  for plane in dev:
    for line in plane.lines:
      if line.name == "XLA Ops":
        lines.append(line)
  if not lines:   # CPU: whatever the host recorded
    lines = [line for p in planes if p.name.startswith("/host")
             for line in p.lines]
  names = {p.name: [line.name for line in p.lines] for p in planes}
  return [(ev.name, ev.duration_ns) for line in lines
          for ev in line.events], names


def profile_row(fn, args, steps, trace_dir):
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  with jax.profiler.trace(trace_dir):
    for _ in range(steps):
      out = fn(*args)
    jax.block_until_ready(out)
  wall = (time.perf_counter() - t0) / steps
  found = []
  for root, _, files in os.walk(trace_dir):
    found += [os.path.join(root, f) for f in files if f.endswith(".xplane.pb")]
  if not found:
    raise RuntimeError(f"the profiler wrote no .xplane.pb under {trace_dir}")
  pdata = jax.profiler.ProfileData.from_file(max(found, key=os.path.getmtime))
  ops, names = device_ops(pdata)
  return ops, names, wall


def summarize(ops, index, steps, top):
  by_name = collections.defaultdict(lambda: [0, 0])
  for name, ns in ops:
    by_name[name][0] += ns
    by_name[name][1] += 1
  classes = collections.defaultdict(float)
  rows, loops = [], 0.0
  for name, (ns, n) in by_name.items():
    info = index.get(event_instruction(name))
    cls = op_class(info)
    ms = ns / steps / 1e6
    if info is not None and info["opcode"] in CONTAINERS:
      loops += ms
    else:
      classes[cls] += ms
    rows.append(dict(name=name, ms_per_step=ms, runs_per_step=n / steps,
                     cls=cls, op_name=(info or {}).get("op_name"),
                     kind=(info or {}).get("kind")))
  rows.sort(key=lambda r: -r["ms_per_step"])
  busy = sum(classes.values())
  return dict(busy_ms=busy, loops_ms=loops,
              classes=dict(sorted(classes.items(), key=lambda kv: -kv[1])),
              top=rows[:top], distinct_ops=len(rows))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--workload", nargs="+", choices=A.WORKLOADS,
                 default=list(A.WORKLOADS))
  p.add_argument("--hidden", nargs="+", type=int, default=None)
  p.add_argument("--impls", nargs="+", choices=A.IMPLS, default=list(A.IMPLS))
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--layers", type=int, default=None)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  on_accel = jax.default_backend() in ("tpu", "gpu")
  if not (on_accel or args.smoke):
    print("accel_profile.py: no TPU or GPU here; use --smoke. Exiting.")
    return None
  smoke = args.smoke
  hiddens = args.hidden or ([32] if smoke else [2048])
  batch = args.batch or (64 if smoke else 8192)
  layers = args.layers or (2 if smoke else 8)
  out = args.out or os.path.join(tempfile.gettempdir(),
                                 f"accel_profile_{os.getpid()}.json")
  hlo_dir = os.path.splitext(out)[0] + "_hlo"
  os.makedirs(hlo_dir, exist_ok=True)
  machine, versions = A.machine_info()
  doc = dict(schema=SCHEMA, machine=machine, versions=versions,
             argv=list(sys.argv[1:] if argv is None else argv),
             config=dict(batch=batch, layers=layers, hiddens=hiddens,
                         steps=args.steps, interpret=not on_accel),
             results=[], errors=[])
  dtype = jnp.bfloat16
  for workload in args.workload:
    for hidden in hiddens:
      params, x = A.make_inputs(workload, layers, batch, hidden, dtype)
      for impl in args.impls:
        label = f"{workload}/{hidden}/{impl}"
        try:
          fn = A.stack_grad(A.build(workload, impl, not on_accel,
                                    16 if smoke else None,
                                    16 if smoke else None))
          compiled = fn.lower(params, x).compile()
          text = compiled.as_text()
          with gzip.open(os.path.join(hlo_dir, label.replace("/", "_")
                                      + ".hlo.txt.gz"), "wt") as fh:
            fh.write(text)
          with tempfile.TemporaryDirectory() as tdir:
            ops, planes, wall = profile_row(compiled, (params, x), args.steps, tdir)
          s = summarize(ops, hlo_index(text), args.steps, args.top)
          doc.setdefault("planes", planes)
          doc["results"].append(dict(workload=workload, hidden=hidden,
                                     impl=impl, wall_ms=wall * 1e3, **s))
          print(f"{label}: step {wall * 1e3:.2f} ms, ops {s['busy_ms']:.2f} "
                f"ms; " + ", ".join(f"{k} {v:.2f}" for k, v in
                                    list(s["classes"].items())[:6]),
                flush=True)
        except Exception as e:   # noqa: BLE001 -- recorded, the run goes on
          doc["errors"].append(dict(row=label, error=f"{type(e).__name__}: "
                                    f"{e}"[:2000]))
          print(f"{label}: ERROR {type(e).__name__}: {str(e)[:300]}",
                flush=True)
        with open(out, "w") as fh:
          json.dump(doc, fh, indent=1)
  print(f"JSON: {out}; HLO: {hlo_dir}")
  return doc


if __name__ == "__main__":
  main()
