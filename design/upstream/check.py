#!/usr/bin/env python3
"""Checks the JAX patches in this folder against JAX's own tests and the new
launch-count tests, on each JAX target.

Per target (jax 0.12.0.1 on Python 3.13, jax 0.11.0 on Python 3.12), in a
scratch folder, it:

1. makes a virtualenv and installs jax and jaxlib from PyPI (through pip's
   cache), absl-py, pytest and pytest-xdist;
2. unpatched: runs JAX's ``custom_api_test.py`` (the matching file from
   ``--peer``) and the new tests that pin today's behaviour
   (``CustomVJPRematTodayTest``);
3. applies part 1 (``optimize_remat='policy'``) with ``patch -p1`` inside
   site-packages and runs the new tests that need only it;
4. applies part 2 (``fwd_bwd``) on top, and runs ``custom_api_test.py`` and
   every new test, recording the launches each count test measured.

It prints the tests of ``custom_api_test.py`` that fail only when patched
(there must be none), the pass counts and the launch-count tables, writes
them all with ``--json``, and exits 0 only when every patch applies, no test
that passes unpatched fails patched, and every new test passes wherever it
runs. Two optional checks take minutes more: ``--api-tests DIR``
(``DIR/<peer folder name>/api_test.py``, JAX's ``tests/api_test.py`` at the
matching version) runs that file's ``RematTest`` and ``Remat3Test`` unpatched
and patched; ``--force-policy`` runs ``custom_api_test.py`` once more, patched,
with ``optimize_remat='policy'`` forced on every ``custom_vjp`` that does not
set ``optimize_remat`` itself.

Usage, from the repository root:
  python3.13 design/upstream/check.py --peer ../shared/peer --json out.json
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
NEW_TESTS = 'custom_vjp_remat_test.py'


@dataclasses.dataclass(frozen=True)
class Target:
  jax: str            # the jax and jaxlib version to install
  python: str         # the Python minor version to run it on
  peer: str           # folder of --peer holding the matching custom_api_test.py
  patches: tuple[str, str]  # part 1, part 2, in this folder


TARGETS = (
    Target('0.12.0.1', '3.13', 'jax-main-2026-08-08',
           ('jax-0.12.0.1-1-optimize_remat_policy.patch',
            'jax-0.12.0.1-2-fwd_bwd.patch')),
    Target('0.11.0', '3.12', 'jax-v0.11.0',
           ('jax-0.11.0-1-optimize_remat_policy.patch',
            'jax-0.11.0-2-fwd_bwd.patch')),
)

# A conftest.py for --force-policy: the opt-in on every custom_vjp whose
# defvjp call does not set optimize_remat itself.
FORCE_CONFTEST = """\
from jax._src import custom_derivatives, hijax

def _forcing(defvjp):
  def forced(self, fwd, bwd, *args, **kwargs):
    if len(args) < 2 and not kwargs.get('optimize_remat'):
      kwargs['optimize_remat'] = 'policy'
    return defvjp(self, fwd, bwd, *args, **kwargs)
  return forced

custom_derivatives.custom_vjp.defvjp = _forcing(custom_derivatives.custom_vjp.defvjp)
hijax.custom_vjp3.defvjp = _forcing(hijax.custom_vjp3.defvjp)
"""

# Selections of the new tests (pytest -k).
TODAY = 'CustomVJPRematTodayTest'
PART1 = 'CustomVJPRematPolicyTest or CustomVJPPolicyElsewhereTest'


class CheckError(Exception):
  pass


def log(msg):
  print(msg, flush=True)


def find_python(version, given):
  """An interpreter for Python ``version`` (like '3.12') that runs: the one
  given, this one, the newest pyenv build, or python<version> on PATH."""
  candidates = [given[version]] if version in given else []
  if sys.version_info[:2] == tuple(map(int, version.split('.'))):
    candidates.append(sys.executable)
  roots = [os.environ.get('PYENV_ROOT', ''), os.path.expanduser('~/.pyenv')]
  for root in filter(None, roots):
    builds = glob.glob(os.path.join(root, 'versions', f'{version}.*'))
    builds.sort(key=lambda p: [int(x) if x.isdigit() else -1 for x in
                               os.path.basename(p).split('.')], reverse=True)
    candidates += [os.path.join(b, 'bin', 'python') for b in builds]
  if shutil.which(f'python{version}'):
    candidates.append(shutil.which(f'python{version}'))
  for python in candidates:
    try:
      out = subprocess.run([python, '-c', 'import sys; print(*sys.version_info[:2])'],
                           capture_output=True, text=True, timeout=60)
    except OSError:
      continue
    if out.returncode == 0 and out.stdout.split() == version.split('.'):
      return python
  raise CheckError(f'no working Python {version} (tried {candidates or "none"}); '
                   f'pass --python {version}=/path/to/python')


def run(cmd, *, cwd=None, env=None, check=True):
  proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
  if check and proc.returncode != 0:
    raise CheckError(f'command failed ({proc.returncode}): {" ".join(cmd)}\n'
                     f'{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}')
  return proc


def clean_env():
  """The environment without JAX_ flags (a JAX_REMAT3 set outside would
  change what the tests measure), on the CPU."""
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_')}
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def make_venv(target, python, work):
  """A virtualenv with the target's jax; returns (python, site-packages)."""
  venv = os.path.join(work, f'venv-jax{target.jax}')
  run([python, '-m', 'venv', venv])
  py = os.path.join(venv, 'bin', 'python')
  run([py, '-m', 'pip', 'install', '-q', '--disable-pip-version-check',
       f'jax=={target.jax}', f'jaxlib=={target.jax}', 'absl-py', 'pytest',
       'pytest-xdist'])
  site = run([py, '-c', 'import os, jax; '
              'print(os.path.dirname(os.path.dirname(jax.__file__)))'],
             env=clean_env()).stdout.strip()
  version = run([py, '-c', 'import jax, jaxlib; '
                 'print(jax.__version__, jaxlib.__version__)'],
                env=clean_env()).stdout.split()
  if version != [target.jax, target.jax]:
    raise CheckError(f'installed jax/jaxlib {version}, wanted {target.jax}')
  return py, site


def apply_patch(site, patch):
  path = os.path.join(HERE, patch)
  for extra in (['--dry-run'], []):
    proc = run(['patch', '-p1', '--forward', '--batch', '-d', site, '-i', path,
                *extra], check=False)
    if proc.returncode != 0:
      raise CheckError(f'{patch} does not apply to {site}:\n{proc.stdout}'
                       f'{proc.stderr}')


def pytest(py, folder, test_file, jobs, *, select=None, counts_file=None):
  """Runs pytest; returns ``{test id: 'passed' | 'failed' | 'skipped'}``."""
  xml = os.path.join(folder, f'junit-{time.monotonic_ns()}.xml')
  cmd = [py, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-n', str(jobs),
         f'--junitxml={xml}', test_file]
  if select:
    cmd += ['-k', select]
  env = clean_env()
  if counts_file:
    env['MEASURED_COUNTS_FILE'] = counts_file
  proc = run(cmd, cwd=folder, env=env, check=False)
  if not os.path.exists(xml):
    raise CheckError(f'pytest wrote no report: {" ".join(cmd)}\n'
                     f'{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}')
  outcomes = {}
  for case in ET.parse(xml).getroot().iter('testcase'):
    key = f"{case.get('classname')}::{case.get('name')}"
    if case.find('failure') is not None or case.find('error') is not None:
      outcomes[key] = 'failed'
    elif case.find('skipped') is not None:
      outcomes[key] = 'skipped'
    else:
      outcomes[key] = 'passed'
  if proc.returncode not in (0, 1) or not outcomes:
    raise CheckError(f'pytest did not run the tests ({proc.returncode}): '
                     f'{" ".join(cmd)}\n{proc.stdout[-4000:]}\n'
                     f'{proc.stderr[-4000:]}')
  return outcomes


def tally(outcomes):
  c = collections.Counter(outcomes.values())
  return dict(passed=c['passed'], failed=c['failed'], skipped=c['skipped'])


def failed(outcomes):
  return sorted(k for k, v in outcomes.items() if v == 'failed')


def check_target(target, py, site, peer, jobs, work, api_tests, force,
                 timings):
  """Runs every step for one target; returns its JSON record."""
  folder = os.path.join(work, f'tests-jax{target.jax}')
  os.makedirs(folder)
  peer_file = os.path.join(peer, target.peer, 'custom_api_test.py')
  if not os.path.exists(peer_file):
    raise CheckError(f'{peer_file} is missing')
  shutil.copy(peer_file, folder)
  shutil.copy(os.path.join(HERE, NEW_TESTS), folder)
  api_file = None
  if api_tests:
    api_file = os.path.join(api_tests, target.peer, 'api_test.py')
    if not os.path.exists(api_file):
      raise CheckError(f'{api_file} is missing')
    shutil.copy(api_file, folder)
  counts_file = os.path.join(folder, 'counts.jsonl')
  rec = dict(jax=target.jax, python=target.python, peer_file=peer_file,
             patches=list(target.patches))

  def step(name, fn):
    t0 = time.monotonic()
    log(f'[jax {target.jax}] {name} ...')
    out = fn()
    timings[f'jax {target.jax}: {name}'] = round(time.monotonic() - t0, 1)
    return out

  suite = 'custom_api_test.py'
  remat_k = 'RematTest or Remat3Test'
  suite_before = step('custom_api_test.py, unpatched',
                      lambda: pytest(py, folder, suite, jobs))
  today_before = step('new tests pinning today, unpatched',
                      lambda: pytest(py, folder, NEW_TESTS, jobs, select=TODAY))
  if api_file:
    api_before = step('api_test.py remat classes, unpatched',
                      lambda: pytest(py, folder, 'api_test.py', jobs,
                                     select=remat_k))
  step('apply part 1', lambda: apply_patch(site, target.patches[0]))
  part1 = step('new tests of part 1, part 1 applied',
                lambda: pytest(py, folder, NEW_TESTS, jobs, select=PART1))
  step('apply part 2', lambda: apply_patch(site, target.patches[1]))
  suite_after = step('custom_api_test.py, patched',
                     lambda: pytest(py, folder, suite, jobs))
  new_after = step('new tests, patched',
                   lambda: pytest(py, folder, NEW_TESTS, jobs,
                                  counts_file=counts_file))
  if api_file:
    api_after = step('api_test.py remat classes, patched',
                     lambda: pytest(py, folder, 'api_test.py', jobs,
                                    select=remat_k))
  if force:
    forced_dir = os.path.join(folder, 'forced')
    os.makedirs(forced_dir)
    shutil.copy(peer_file, forced_dir)
    with open(os.path.join(forced_dir, 'conftest.py'), 'w') as f:
      f.write(FORCE_CONFTEST)
    suite_forced = step("custom_api_test.py, patched, 'policy' forced",
                        lambda: pytest(py, forced_dir, suite, jobs))

  regressions = sorted(k for k, v in suite_after.items()
                       if v == 'failed' and suite_before.get(k) == 'passed')
  missing = sorted(set(suite_before) - set(suite_after))
  rec['custom_api_test'] = dict(unpatched=tally(suite_before),
                                patched=tally(suite_after),
                                failing_unpatched=failed(suite_before),
                                failing_only_patched=regressions,
                                not_run_patched=missing)
  rec['new_tests'] = dict(today_unpatched=tally(today_before),
                          part1_only=tally(part1),
                          patched=tally(new_after),
                          failing=sorted(set(failed(today_before)) |
                                         set(failed(part1)) |
                                         set(failed(new_after))))
  if force:
    forced_regressions = sorted(k for k, v in suite_forced.items()
                                if v == 'failed' and suite_before.get(k) == 'passed')
    rec['custom_api_test']['forced'] = tally(suite_forced)
    rec['custom_api_test']['failing_only_forced'] = forced_regressions
  if api_file:
    api_regressions = sorted(k for k, v in api_after.items()
                             if v == 'failed' and api_before.get(k) == 'passed')
    rec['api_test_remat'] = dict(unpatched=tally(api_before),
                                 patched=tally(api_after),
                                 failing_only_patched=api_regressions)
  rec['launches'] = []
  if os.path.exists(counts_file):
    with open(counts_file) as f:
      rec['launches'] = [json.loads(line) for line in f if line.strip()]
  rec['ok'] = (not regressions and not missing and not rec['new_tests']['failing']
               and (not api_file or not rec['api_test_remat']['failing_only_patched'])
               and (not force or not rec['custom_api_test']['failing_only_forced']))
  return rec


MODE_NAMES = dict(default='optimize_remat=False', true='=True',
                  defremat='defremat by hand', policy="='policy'",
                  policy_fused="'policy'+fwd_bwd", true_fused='True+fwd_bwd')


def launch_tables(rec):
  """Text tables of the launches the count tests measured."""
  rows = rec['launches']
  if not rows:
    return 'no launch counts recorded\n'
  cell = {(r['program'], r['mode'], r['policy'], r['kernel'], r['jit']):
          r['counts'] for r in rows if r['remat3'] and r['custom_vjp3']}
  out = []
  modes = [m for m in MODE_NAMES if any(k[1] == m for k in cell)]
  for kernel in ('callback', 'never_dce'):
    out.append(f'\njax {rec["jax"]}: value_and_grad(checkpoint(F)), {kernel} '
               'kernels, launches per step')
    head = ['policy', 'jit'] + [MODE_NAMES[m] for m in modes]
    table = [head]
    for policy in ('nothing', 'everything', 'dots', 'names'):
      for jit in (False, True):
        table.append([policy, 'jit' if jit else 'eager'] +
                     [cell.get(('plain', m, policy, kernel, jit), '-')
                      for m in modes])
    out.append(format_table(table))
  progs = sorted({k[0] for k in cell} - {'plain', 'grad_of_grad'})
  out.append(f'\njax {rec["jax"]}: other programs, jit, callback kernels '
             "(policy nothing / names), optimize_remat=False -> 'policy' -> "
             "'policy'+fwd_bwd")
  table = [['program', 'nothing', 'names']]
  for prog in progs:
    line = [prog]
    for policy in ('nothing', 'names'):
      got = [cell.get((prog, m, policy, 'callback', True), '-')
             for m in ('default', 'policy', 'policy_fused')]
      line.append(' -> '.join(got))
    table.append(line)
  out.append(format_table(table))
  return '\n'.join(out) + '\n'


def format_table(rows):
  widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
  return '\n'.join('  '.join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                   for r in rows)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--peer', required=True,
                  help="folder with JAX's custom_api_test.py per version "
                       '(jax-v0.11.0/, jax-main-2026-08-08/)')
  ap.add_argument('--json', help='write the results here')
  ap.add_argument('--jobs', type=int, default=2, help='pytest-xdist workers')
  ap.add_argument('--only', choices=[t.jax for t in TARGETS], action='append',
                  help='check only this jax version (repeatable)')
  ap.add_argument('--python', action='append', default=[], metavar='X.Y=PATH',
                  help='the interpreter for Python X.Y')
  ap.add_argument('--api-tests', metavar='DIR',
                  help="also run api_test.py's remat classes from "
                       'DIR/<peer folder>/api_test.py')
  ap.add_argument('--force-policy', action='store_true',
                  help="also run custom_api_test.py with optimize_remat='policy' "
                       'forced on every custom_vjp')
  ap.add_argument('--work', help='scratch folder (default: a new temporary '
                  'one, removed at the end)')
  args = ap.parse_args(argv)
  t_start = time.monotonic()
  peer = os.path.abspath(args.peer)
  given = dict(p.split('=', 1) for p in args.python)
  targets = [t for t in TARGETS if not args.only or t.jax in args.only]
  work = args.work or tempfile.mkdtemp(prefix='upstream-check-')
  os.makedirs(work, exist_ok=True)
  result = dict(ok=False, targets=[], timings={})
  timings = result['timings']
  try:
    if shutil.which('patch') is None:
      raise CheckError('the patch program is missing')
    if not os.path.isdir(peer):
      raise CheckError(f'--peer {peer} is not a folder')
    pythons = {t.python: find_python(t.python, given) for t in targets}
    t0 = time.monotonic()
    log('installing ' + ', '.join(f'jax {t.jax} (Python {t.python})'
                                  for t in targets) + ' ...')
    with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
      venvs = list(pool.map(lambda t: make_venv(t, pythons[t.python], work),
                            targets))
    timings['install'] = round(time.monotonic() - t0, 1)
    for target, (py, site) in zip(targets, venvs):
      result['targets'].append(check_target(
          target, py, site, peer, args.jobs, work, args.api_tests,
          args.force_policy, timings))
    result['ok'] = all(r['ok'] for r in result['targets'])
  except CheckError as e:
    result['error'] = str(e)
    log(f'ERROR: {e}')
  finally:
    result['seconds'] = round(time.monotonic() - t_start, 1)
    if not args.work:
      shutil.rmtree(work, ignore_errors=True)

  for rec in result['targets']:
    s, n = rec['custom_api_test'], rec['new_tests']
    log(f'\n=== jax {rec["jax"]} (Python {rec["python"]}) ===')
    log(f'custom_api_test.py ({os.path.basename(os.path.dirname(rec["peer_file"]))}): '
        f'unpatched {s["unpatched"]}, patched {s["patched"]}')
    log('  failing only when patched: ' +
        (', '.join(s['failing_only_patched']) or 'none'))
    if 'forced' in s:
      log(f"  with 'policy' forced on every custom_vjp: {s['forced']}; failing "
          'only then: ' + (', '.join(s['failing_only_forced']) or 'none'))
    if s['not_run_patched']:
      log('  run unpatched but not patched: ' + ', '.join(s['not_run_patched']))
    log(f'new tests: today\'s behaviour unpatched {n["today_unpatched"]}; '
        f'part 1 only {n["part1_only"]}; both parts {n["patched"]}')
    if n['failing']:
      log('  FAILING: ' + ', '.join(n['failing']))
    if 'api_test_remat' in rec:
      a = rec['api_test_remat']
      log(f'api_test.py RematTest/Remat3Test: unpatched {a["unpatched"]}, '
          f'patched {a["patched"]}; failing only when patched: ' +
          (', '.join(a['failing_only_patched']) or 'none'))
    log(launch_tables(rec))
  log('timings (s): ' + ', '.join(f'{k} {v}' for k, v in timings.items()))
  log(f'total {result["seconds"]} s: ' + ('OK' if result['ok'] else 'FAILED'))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(result, f, indent=1)
  return 0 if result['ok'] else 1


if __name__ == '__main__':
  sys.exit(main())
