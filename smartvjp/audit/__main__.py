"""``python -m smartvjp.audit path/to/script.py:function``: audit a step in a
script you did not change.

The script is loaded as a module (its ``if __name__ == "__main__":`` block
does not run) and ``function`` is audited on the arguments named by
``--args`` (a module-level tuple, or a function returning one), else on
``<function>_args`` where the script defines it, else with no arguments
(its defaults). Prints the table; ``--json``/``--html`` write the report;
``--measure`` times the compiled steps too, ``--calibrate`` each site's
rules on the values the step gives them (``--timing-budget`` seconds of
timing rounds at most).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from smartvjp import audit as _audit


def _arguments(ns: dict, function: str, name: str | None) -> tuple:
  value = ns.get(name or f"{function}_args", ())
  if name is not None and name not in ns:
    raise SystemExit(f"smartvjp.audit: the script defines no {name!r} "
                     "(--args names a module-level tuple of arguments, or "
                     "a function returning one)")
  value = value() if callable(value) else value
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m smartvjp.audit",
      description="Audit the custom_vjp sites of a step: rule runs per "
      "step as written and swapped, residuals, predicted saving.")
  parser.add_argument("target", help="path/to/script.py:function")
  parser.add_argument("--args", default=None,
                      help="module-level name of the arguments (a tuple, or "
                      "a function returning one); default <function>_args")
  parser.add_argument("--json", metavar="PATH", help="write the JSON report")
  parser.add_argument("--html", metavar="PATH", help="write the HTML page")
  parser.add_argument("--measure", action="store_true",
                      help="also time the compiled steps (A/B, interleaved)")
  parser.add_argument("--calibrate", action="store_true",
                      help="also time each site's rules on the values the "
                      "step gives them, and the step, and predict from "
                      "those times (implied by --measure)")
  parser.add_argument("--timing-budget", type=float, metavar="SECONDS",
                      default=_audit._calibrate.BUDGET_S,
                      help="seconds of timing rounds for --calibrate "
                      "(default %(default)s)")
  opts = parser.parse_args(argv)
  path, sep, function = opts.target.rpartition(":")
  if not sep or not path:
    parser.error("target must be path/to/script.py:function")
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    parser.error(f"no script at {path}")
  # run under the script's own name (its sites are named after it, not
  # after the audit), its folder importable as when run directly
  module = os.path.splitext(os.path.basename(path))[0]
  sys.path.insert(0, os.path.dirname(path))
  ns = runpy.run_path(path, run_name=module)
  if function not in ns:
    parser.error(f"{path} defines no {function!r}")
  args = _arguments(ns, function, opts.args)
  if not args and opts.args is None:
    print(f"smartvjp.audit: {path} defines no {function}_args: auditing "
          f"{function}() with no arguments (--args NAME names a module-level "
          "tuple of arguments, or a function returning one)", file=sys.stderr)
  try:
    report = _audit.audit(ns[function], *args, measure=opts.measure,
                          calibrate=opts.calibrate,
                          timing_budget=opts.timing_budget)
  except (_audit.AuditError, TypeError, ValueError) as e:
    print(e, file=sys.stderr)
    return 2
  print(report.table())
  for write, out in ((report.to_json, opts.json), (report.to_html, opts.html)):
    if out:
      write(os.path.abspath(out))
      print(f"wrote {os.path.abspath(out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
