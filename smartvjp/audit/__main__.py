"""``python -m smartvjp.audit path/to/script.py:function``: audit a step in a
script you did not change.

The script is loaded as a module (its ``if __name__ == "__main__":`` block
does not run) and ``function`` is audited on the arguments named by
``--args`` (a module-level tuple, or a function returning one), else on
``<function>_args`` where the script defines it, else with no arguments
(its defaults). Prints the table; ``--json``/``--html`` write the report;
``--measure`` times the compiled steps too.
"""

from __future__ import annotations

import argparse
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
  opts = parser.parse_args(argv)
  path, sep, function = opts.target.rpartition(":")
  if not sep or not path:
    parser.error("target must be path/to/script.py:function")
  ns = runpy.run_path(path, run_name="__smartvjp_audit__")
  if function not in ns:
    parser.error(f"{path} defines no {function!r}")
  try:
    report = _audit.audit(ns[function], *_arguments(ns, function, opts.args),
                          measure=opts.measure)
  except _audit.AuditError as e:
    print(e, file=sys.stderr)
    return 2
  print(report.table())
  if opts.json:
    report.to_json(opts.json)
  if opts.html:
    report.to_html(opts.html)
  return 0


if __name__ == "__main__":
  sys.exit(main())
