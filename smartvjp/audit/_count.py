"""The audit's counts: how often each tagged rule runs per step, read from a
jaxpr and from a compiled program's HLO text (nothing is run or changed).

A rule traced by the audit runs under a named scope ``svjpaudit_<site>_
<call>_<role>`` (``tag``), which JAX keeps in each equation's name stack and
XLA in each instruction's ``op_name``. One *run* of a rule is one place its
tagged work appears: per jaxpr (or HLO computation, fusions and calls
inlined), the distinct name-stack contexts that end in the tag; for a rule
whose work is opaque to XLA (a custom call: Pallas, FFI, a host callback),
the custom calls it launches. Loop bodies multiply by their trip count
(``scan``'s ``length``; XLA's ``known_trip_count``, or, where the compiler
prints none, as XLA's TPU backend does, the bound of the loop's condition:
one ``LT`` comparison with one integer constant, as ``scan`` lowers), and a
conditional
counts its costliest branch (exactly one branch runs).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Callable, Iterable

from smartvjp import _facade as jx
from smartvjp import _jaxprs

ROLES = ("f", "fwd", "bwd", "fwd_bwd")
TAG = re.compile(r"svjpaudit_(\d+)_(\d+)_(fwd_bwd|fwd|bwd|f)(?![\w])")

# custom calls XLA itself uses for placement and layout, not kernels
NOT_KERNELS = frozenset({
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "MoveToHost",
    "MoveToDevice", "annotate_device_placement", "LayoutConstraint",
    "X64Combine", "X64SplitLow", "X64SplitHigh", "AllocateBuffer",
    "PartitionId", "ReplicaId"})
COLLECTIVES = _jaxprs.COLLECTIVE_PRIMITIVES


def tag(site: int, call: int, role: str) -> str:
  return f"svjpaudit_{site}_{call}_{role}"


Key = tuple  # (site, call, role)


def _tags(text: str) -> list[tuple[Key, str]]:
  """Each tag in a name stack, with its context: the stack up to the tag's
  own segment, then the tag, without the transformations wrapped round it
  there (``jvp(<tag>)``, ``transpose(jvp(<tag>))``: a rule's equations and
  their derivative under higher-order differentiation are one run). An
  instruction XLA made of several (a fusion, on jax 0.12) joins their
  names with ``;`` (jax 0.10 writes the later ones without their
  prefix): each is read apart, and a rule's tag counts once per
  instruction, with the first name's context (one instruction is one
  place, not one per name joined). Within one name only a site's
  outermost tag counts: a rule that calls its own site (JAX's flash
  attention's ``fwd`` calls ``f``) runs once, not once as each."""
  out, keys = [], set()
  for part in text.split(";"):
    sites = set()
    for m in TAG.finditer(part):
      key = (int(m[1]), int(m[2]), m[3])
      if key[0] in sites:   # the site called inside its own rule (a fwd
        continue            # calling f): that work is the outer rule's run
      sites.add(key[0])
      if key not in keys:
        keys.add(key)
        start = part.rfind("/", 0, m.start()) + 1
        out.append((key, part[:start] + m[0]))
  return out


class _Local:
  """What one body (jaxpr or computation) holds of each rule: the
  name-stack contexts of its work, and of its kernels apart."""

  def __init__(self):
    self.contexts = collections.defaultdict(set)
    self.kernel_contexts = collections.defaultdict(set)
    self.kernels = collections.Counter()

  def add(self, name: str, opaque: bool, skip=frozenset()):
    for key, context in _tags(name):
      if key in skip:
        continue
      self.contexts[key].add(context)
      if opaque:
        self.kernels[key] += 1
        self.kernel_contexts[key].add(context)

  def drop_hoisted(self, nested: Iterable[Key]) -> None:
    """Forgets this body's work of each JAX-coded rule that also runs in a
    loop or branch below it (``nested``: their keys). One trace of a rule
    (one key) placed both here and in a loop body below is the loop's
    run with a loop-invariant piece moved out of the loop, by JAX's
    ``scan`` partial evaluation (a residual of loop-invariant inputs) or by
    XLA's loop-invariant code motion (which keeps the body's ``op_name``):
    part of the loop's runs, not one more (brainstate's embedding and
    diffrax's sites counted ``fwd 9`` for 8). A rule with kernels here
    keeps its count: its kernels are its runs."""
    # (a branch's keys are per site and role: call -1, _merge_max)
    below = {k for k in nested if k[1] >= 0} | {
        (site, call, role) for site, call, role in self.contexts
        if (site, -1, role) in nested}
    for key in below:
      if key in self.contexts and not self.kernels.get(key):
        del self.contexts[key]

  def runs(self, per_run: Callable[[Key], int]) -> collections.Counter:
    """A rule with kernels runs once per place its kernels are (or per
    ``per_run`` kernels); a JAX-coded rule once per place its work is."""
    out = collections.Counter()
    for key, ctx in self.contexts.items():
      k = self.kernels.get(key, 0)
      out[key] = (max(len(self.kernel_contexts[key]),
                      math.ceil(k / max(per_run(key), 1))) if k else len(ctx))
    return out


def _merge_max(counters: Iterable[collections.Counter]) -> collections.Counter:
  """Per (site, role), the most any one branch runs (its calls summed: two
  branches calling one site make two calls, of which one runs)."""
  out = collections.Counter()
  for c in counters:
    mine = collections.Counter()
    for (site, _, role), v in c.items():
      mine[(site, -1, role)] += v
    for k, v in mine.items():
      out[k] = max(out[k], v)
  return out


def _scaled(c: collections.Counter, n: int) -> collections.Counter:
  return collections.Counter({k: v * n for k, v in c.items()})


# -- jaxprs ----------------------------------------------------------------------

# equations that, staged unread and without effects, are no run of the
# step: a custom_vjp call JAX did not differentiate (after AD, a
# differentiated call is its rules' equations), and control flow
_UNREAD_NOT_RUN = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr",
                             "while", "scan", "cond"})


def read_equations(jaxpr) -> list:
  """The equations of ``jaxpr`` (one level), without the undifferentiated
  ``custom_vjp`` calls and the loops and conditionals whose results
  nothing reads and that have no effects. A step's jaxpr can hold such
  an equation: JAX traces a ``custom_vjp``'s ``fwd`` lazily under
  ``scan``, and what that ``fwd`` stages of its own (a ``custom_vjp`` it
  calls: netket's and exojax's sites, seen on jax 0.10.2 and 0.12.1; a
  ``while_loop`` around a kernel: jaxpr ``fwd 5`` where 4 ran) lands,
  unread, at the top level, where it would count one run too many. Other
  unread work stays: the forward pass's ``fwd`` under ``jax.grad`` is in
  the jaxpr, and XLA removing it is what the compiled count shows. An
  equation with no results and no effects is left out too: a
  ``jax.jit`` called inside such a ``fwd`` is staged at the top level as
  an empty ``jit`` that still carries the rule's name (seen on jax
  0.12.1), which would count one run too many and place the site
  outside its loops."""
  read = {v for v in jaxpr.outvars if isinstance(v, jx.core.Var)}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    if not eqn.outvars and not eqn.effects:
      continue
    if (eqn.primitive.name not in _UNREAD_NOT_RUN or eqn.effects
        or any(v in read for v in eqn.outvars)):
      kept.append(eqn)
      read.update(v for v in eqn.invars if isinstance(v, jx.core.Var))
  return kept[::-1]


@dataclasses.dataclass
class JaxprCount:
  runs: collections.Counter          # (site, call, role) -> runs per step
  paths: dict                        # (site, call) -> [nesting paths seen]
  rematted: set                      # (site, call) seen in a rematted region
  multiplicity: dict                 # (site, call) -> loop trips around it
  notes: list                        # e.g. a while loop of unknown trip count


def count_jaxpr(jaxpr, sub_jaxprs: Callable, name_of: Callable,
                per_run: Callable[[Key], int]) -> JaxprCount:
  """Runs per step in ``jaxpr`` (a ``jx.core.Jaxpr``).

  ``sub_jaxprs(eqn) -> (kind, [(jaxpr, label)...])``: what an equation runs
  of other jaxprs, ``kind`` one of ``"inline"`` (runs once: ``jit``, remat,
  smartvjp's rules), ``"loop"`` (``label`` is the trip count or ``None``),
  ``"branches"`` (one of them runs) or ``None``. ``name_of(eqn)``: its name
  stack as a string. Equations whose results nothing reads are left out
  (``read_equations``): they are not runs of the step."""
  paths, mult, notes, rematted = {}, {}, [], set()

  def body(jaxpr, path, trips, outer=frozenset()) -> collections.Counter:
    # outer: the sites whose rule this body runs inside (a fwd calling its
    # own site's f: that work is the outer rule's run, as in _tags)
    local, total = _Local(), collections.Counter()

    def visit(jaxpr, path, prefix="", outer=outer):
      for i, eqn in enumerate(read_equations(jaxpr)):
        name = prefix + name_of(eqn)
        tags = [(k, c) for k, c in _tags(name) if k[0] not in outer]
        local.add(name, _jaxprs.is_opaque_kernel(eqn),
                  {k for k, _ in _tags(name) if k[0] in outer})
        for key, _ in tags:
          seen = paths.setdefault(key[:2], [])
          if tuple(path) not in seen:
            seen.append(tuple(path))
          mult.setdefault(key[:2], trips)
          if "rematted_computation" in name:
            rematted.add(key[:2])
        inner = outer | {k[0] for k, _ in tags}
        kind, subs = sub_jaxprs(eqn)
        if kind == "inline":
          for j, (sub, label) in enumerate(subs):
            # each occurrence of a body apart (a jitted function called twice)
            # (under jax_remat3 a rematted region is an equation whose
            # name stack says so, around a body whose names do not)
            mark = "rematted_computation" if "rematted_computation" in name \
                else ""
            visit(sub, path + ([label] if label else []),
                  f"{prefix}{id(jaxpr)}.{i}.{j}{mark}|", inner)
        elif kind == "loop":
          for sub, (label, n) in subs:
            if n is None:
              notes.append(f"{label}: trip count unknown, counted once")
            total.update(_scaled(body(sub, path + [label], trips * (n or 1),
                                      inner), n or 1))
        elif kind == "branches":
          total.update(_merge_max(body(sub, path + [label], trips, inner)
                                  for sub, label in subs))
    visit(jaxpr, path)
    local.drop_hoisted(total)
    total.update(local.runs(per_run))
    return total

  runs = body(jaxpr, [], 1)
  return JaxprCount(runs=runs, paths=paths, rematted=rematted,
                    multiplicity=mult, notes=notes)


# -- compiled HLO text -----------------------------------------------------------

_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CALLEE = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation)"
    r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# (a TPU prints a layout after the shape: s32[]{:T(128)} constant(5))
_INT_CONSTANT = re.compile(r"\b[su]\d+\[\](?:\{[^}]*\})?\s+constant\((\d+)\)")


@dataclasses.dataclass
class Instr:
  opcode: str
  op_name: str
  target: str | None
  callees: dict
  branches: list
  trips: int | None
  constant: int | None = None        # an integer scalar constant's value
  less_than: bool = False            # a compare with direction=LT


def parse_hlo(text: str) -> tuple[dict, str | None]:
  """``({computation: [Instr]}, entry name)`` of an HLO module's text."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    if current is None or (line and not line.startswith(" ")):
      m = _COMP.match(line)
      if m and "=" not in line.split("(")[0]:
        current = comps.setdefault(m[2], [])
        if m[1]:
          entry = m[2]
        continue
      if line.startswith("}"):
        current = None
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    op = _OP_NAME.search(line)
    target = _TARGET.search(line)
    branches = _BRANCHES.search(line)
    trip = _TRIP.search(line)
    const = _INT_CONSTANT.search(line) if m[2] == "constant" else None
    current.append(Instr(
        opcode=m[2], op_name=op[1] if op else "",
        target=target[1] if target else None,
        callees=dict(_CALLEE.findall(line)),
        branches=[b.strip().lstrip("%") for b in branches[1].split(",")]
        if branches else [],
        trips=int(trip[1]) if trip else None,
        constant=int(const[1]) if const else None,
        less_than=m[2] == "compare" and "direction=LT" in line))
  return comps, entry


def condition_bound(comps: dict, name: str | None) -> int | None:
  """The trip count a ``while`` loop's condition computation states when it
  is ``counter < N`` with one integer constant ``N`` (``scan``'s lowering,
  counter from 0), fusions included; else ``None``."""
  constants, compares, seen = set(), 0, set()

  def visit(comp):
    nonlocal compares
    if comp is None or comp in seen:
      return
    seen.add(comp)
    for ins in comps.get(comp, ()):
      if ins.constant is not None:
        constants.add(ins.constant)
      compares += ins.less_than
      for callee in ins.callees.values():
        visit(callee)
  visit(name)
  if compares == 1 and len(constants) == 1:
    return constants.pop()
  return None


def is_kernel(instr: Instr) -> bool:
  """Whether a compiled instruction is an opaque kernel's launch: a custom
  call made by an equation the facade's one definition calls a kernel
  (``_jaxprs.is_opaque_kernel_name`` of the primitive that ends its
  ``op_name``). A custom call XLA or JAX emits for an operation JAX
  sees into (LAPACK's ``lapack_*`` for ``jnp.linalg``, a GPU's cuBLAS
  matmul) is not one; one with no ``op_name`` is judged by its target
  alone."""
  if instr.opcode != "custom-call" or instr.target in NOT_KERNELS:
    return False
  name = instr.op_name.split(";")[0].rsplit("/", 1)[-1]
  return not name or _jaxprs.is_opaque_kernel_name(name)


@dataclasses.dataclass
class HloCount:
  runs: collections.Counter
  kernels: collections.Counter       # (site, call, role) -> custom calls launched
  notes: list
  # each custom call once, however many rules' tags it carries (a site's
  # fwd calling the site: one callback tagged f and fwd is one launch)
  site_launches: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)   # site -> launches
  launches: int = 0                  # the step's, in any rule


def count_hlo(text: str, per_run: Callable[[Key], int]) -> HloCount:
  """Runs (and kernel launches) per step in a compiled module's text."""
  comps, entry = parse_hlo(text)
  notes, launches = [], collections.Counter()
  site_launches, once = collections.Counter(), [0]
  if entry is None:
    return HloCount(collections.Counter(), launches, ["no ENTRY computation"])

  def body(name, skip, factor) -> collections.Counter:
    """Runs in computation ``name`` (its fusions and calls inlined), its
    loops and branches apart."""
    local, total = _Local(), collections.Counter()

    def visit(name, skip):
      for ins in comps.get(name, ()):
        kernel = is_kernel(ins)
        local.add(ins.op_name, kernel, skip)
        if kernel:
          # every launch, in a rule's own loops and branches too
          keys = [key for key, _ in _tags(ins.op_name)]
          for key in keys:
            launches[key] += factor
          for site in {key[0] for key in keys}:
            site_launches[site] += factor
          once[0] += factor if keys else 0
        # a rule's own loops and branches count as part of its run
        inner_skip = skip | {k for k, _ in _tags(ins.op_name)}
        if ins.opcode in ("fusion", "call", "async-start", "custom-call"):
          for role in ("calls", "to_apply"):
            if role in ins.callees and ins.opcode != "custom-call":
              visit(ins.callees[role], skip)
        elif ins.opcode == "while":
          n = ins.trips
          if n is None:
            n = condition_bound(comps, ins.callees.get("condition"))
          if n is None:
            notes.append(f"while {ins.op_name}: trip count unknown, counted "
                         "once")
          total.update(_scaled(body(ins.callees["body"], inner_skip,
                                    factor * (n or 1)), n or 1))
        elif ins.opcode == "conditional":
          names = ins.branches or [ins.callees[k] for k in (
              "true_computation", "false_computation") if k in ins.callees]
          total.update(_merge_max(body(b, inner_skip, factor)
                                  for b in names))
    visit(name, skip)
    local.drop_hoisted(total)
    total.update(local.runs(per_run))
    return total

  runs = body(entry, frozenset(), 1)
  return HloCount(runs, launches, notes, site_launches, once[0])


def per_site(runs: collections.Counter) -> dict:
  """``{site: {role: runs}}`` summed over a site's calls."""
  out = collections.defaultdict(lambda: dict.fromkeys(ROLES, 0))
  for (site, _, role), n in runs.items():
    out[site][role] += n
  return dict(out)
