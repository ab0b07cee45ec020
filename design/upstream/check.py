#!/usr/bin/env python3
"""Checks the patches of this folder against JAX's own tests and their own.

JAX's ``main`` is the target. CI reaches only PyPI, so the default target is
the ``jax==0.11.0`` wheel, whose ``jax/`` is main's first-parent commit
0145058aac (2026-07-16) byte for byte apart from ``version.py``, with jaxlib
0.11.0, on Python 3.12. ``--jax-git DIR`` (a clone of jax-ml/jax) checks that
match and adds the target ``main``: commit cec06d116c (2026-08-08) from
``git archive``, with the same jaxlib.

Per target, with the target's ``jax/`` copied into a scratch folder on
``PYTHONPATH``:

1. unpatched: JAX's ``custom_api_test.py`` (``--peer``'s file for that
   commit, run where it lies) and the new test file, which is expected to
   fail there in part;
2. ``git apply`` PR 1: its test class must pass; JAX's file must fail no test
   that passed unpatched; PR 1's class runs once more with
   ``CustomVJPTraced.remat`` deleted and must then fail where the policy
   saves fwd's residual (the objection that deleting that method would turn
   'policy' into True silently);
3. ``git apply`` PR 2 on top: every new test must pass, and JAX's file must
   again fail no test that passed unpatched.

At each step ``launches.py`` counts the launches of the ``False`` and
``True`` rules (and ``'policy'`` once patched): the ``False`` and ``True``
cells must be those of the unpatched step, and with the patches a fwd with an
array constant under ``dots_saveable`` must run f 1, fwd 1, bwd 1. With
``--jax-git``, ``tests-BUILD.patch`` (the test file's BUILD entry) must apply
to ``tests/BUILD`` of each target commit.

It prints what failed where, pass counts and the time taken (wall and CPU
seconds of its child processes), writes them with ``--json``, and exits 0
only when every check holds. ``--launches`` also prints the launch tables of
``launches.py`` at each step (they are always compared); ``--force-policy`` runs JAX's file once more
with ``optimize_remat='policy'`` forced on every custom_vjp.

Usage, from the repository root:
  python3 design/upstream/check.py --peer ../shared/peer [--jax-git DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import filecmp
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
PATCHES = ('pr1-optimize_remat_policy.patch', 'pr2-saved-residuals.patch')
BUILD_PATCH = 'tests-BUILD.patch'
TEST_FILE = 'custom_vjp_policy_test.py'
# The test class that comes with each patch, in TEST_FILE.
CLASSES = ('CustomVJPOptimizeRematPolicyTest',
           'CustomVJPPolicySavedResidualsTest')
PYTHON = '3.12'
JAXLIB = '0.11.0'
# PR 1's tests that must fail once CustomVJPTraced.remat is deleted.
NEEDS_REMAT_RULE = ('test_launches_everything_saveable',
                    'test_launches_residual_name_saved',
                    'test_launches_residual_saved_jnp_scalar_in_fwd',
                    'test_launches_residual_saved_mask_in_fwd',
                    'test_launches_scan_residual_saved')


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  commit: str        # JAX's main commit that the target's jax/ is
  peer: str          # the folder of --peer with that commit's test file


WHEEL = Target('wheel', '0145058aaca8775b7c8f5a84a5a2e92d575f0722',
               'jax-v0.11.0')
MAIN = Target('main', 'cec06d116c05f0d52adfceee3d3b730fdbcb0ce5',
              'jax-main-2026-08-08')

# A pytest plugin (on PYTHONPATH in a scratch folder) for the objection run.
DROP_REMAT_RULE = """\
from jax._src import hijax
del hijax.CustomVJPTraced.remat
"""

# A pytest plugin for --force-policy: 'policy' on every custom_vjp whose
# defvjp call does not set optimize_remat itself.
FORCE_POLICY = """\
from jax._src import custom_derivatives, hijax

def _forcing(defvjp):
  def forced(self, fwd, bwd, *args, **kwargs):
    if len(args) < 2 and 'optimize_remat' not in kwargs:
      kwargs['optimize_remat'] = 'policy'
    return defvjp(self, fwd, bwd, *args, **kwargs)
  return forced

custom_derivatives.custom_vjp.defvjp = _forcing(custom_derivatives.custom_vjp.defvjp)
hijax.custom_vjp3.defvjp = _forcing(hijax.custom_vjp3.defvjp)
"""


class CheckError(Exception):
  pass


def log(msg):
  print(msg, flush=True)


def run(cmd, *, cwd=None, env=None, check=True):
  proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
  if check and proc.returncode != 0:
    raise CheckError(f'command failed ({proc.returncode}): {" ".join(cmd)}\n'
                     f'{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}')
  return proc


def find_python(given):
  """An interpreter for Python 3.12: the one given, this one, the newest
  pyenv build, or python3.12 on PATH."""
  candidates = [given] if given else []
  if sys.version_info[:2] == (3, 12):
    candidates.append(sys.executable)
  for root in filter(None, [os.environ.get('PYENV_ROOT'),
                            os.path.expanduser('~/.pyenv')]):
    builds = glob.glob(os.path.join(root, 'versions', f'{PYTHON}.*'))
    builds.sort(key=lambda p: [int(x) if x.isdigit() else -1 for x in
                               os.path.basename(p).split('.')], reverse=True)
    candidates += [os.path.join(b, 'bin', 'python') for b in builds]
  if shutil.which(f'python{PYTHON}'):
    candidates.append(shutil.which(f'python{PYTHON}'))
  for python in candidates:
    try:
      out = run([python, '-c', 'import sys; print(*sys.version_info[:2])'],
                check=False)
    except OSError:
      continue
    if out.returncode == 0 and out.stdout.split() == PYTHON.split('.'):
      return python
  raise CheckError(f'no working Python {PYTHON} (tried {candidates or "none"});'
                   ' pass --python /path/to/python3.12')


def make_venv(python, work):
  """A virtualenv with jax and jaxlib 0.11.0 and the test tools from PyPI;
  returns (its python, the installed jax/ folder)."""
  venv = os.path.join(work, 'venv')
  run([python, '-m', 'venv', venv])
  py = os.path.join(venv, 'bin', 'python')
  run([py, '-m', 'pip', 'install', '-q', '--disable-pip-version-check',
       f'jax=={JAXLIB}', f'jaxlib=={JAXLIB}', 'absl-py', 'pytest',
       'pytest-xdist'])
  out = run([py, '-c', 'import os, jax, jaxlib; print(os.path.dirname('
             'jax.__file__)); print(jax.__version__, jaxlib.__version__)'],
            env=base_env(None)).stdout.split('\n')
  if out[1].split() != [JAXLIB, JAXLIB]:
    raise CheckError(f'installed jax/jaxlib {out[1]}, wanted {JAXLIB}')
  return py, out[0]


def git_archive(jax_git, commit, dest):
  """``jax/`` of ``commit`` from the clone ``jax_git`` into ``dest``."""
  os.makedirs(dest)
  archive = subprocess.run(['git', '-C', jax_git, 'archive', commit, 'jax'],
                           capture_output=True, check=True).stdout
  subprocess.run(['tar', '-x', '-C', dest], input=archive, check=True)


def compare_wheel(wheel_jax, jax_git, work):
  """Files of the wheel's jax/ that differ from WHEEL.commit's (version.py is
  stamped at release), and how many the wheel holds."""
  src = os.path.join(work, 'wheel-source')
  git_archive(jax_git, WHEEL.commit, src)
  differ, n = [], 0
  for root, dirs, files in os.walk(wheel_jax):
    dirs[:] = [d for d in dirs if d != '__pycache__']
    for name in files:
      n += 1
      path = os.path.join(root, name)
      rel = os.path.relpath(path, os.path.dirname(wheel_jax))
      other = os.path.join(src, rel)
      if not (os.path.exists(other) and filecmp.cmp(path, other, shallow=False)):
        differ.append(rel)
  return differ, n


def base_env(pythonpath):
  """No JAX_ flags from outside (a JAX_REMAT3 there would change what the
  tests measure), the CPU, no bytecode written next to the test files."""
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_')}
  env.update(JAX_PLATFORMS='cpu', PYTHONDONTWRITEBYTECODE='1', SMART='0')
  env.pop('PYTHONPATH', None)
  if pythonpath:
    env['PYTHONPATH'] = os.pathsep.join(pythonpath)
  return env


def pytest(py, cwd, test_file, jobs, pythonpath, work, *, plugin=None):
  """Runs pytest on ``test_file`` in ``cwd``, where it lies; returns
  ``{test id: 'passed' | 'failed' | 'skipped'}``."""
  xml = os.path.join(work, f'junit-{time.monotonic_ns()}.xml')
  cmd = [py, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', f'--junitxml={xml}',
         '--rootdir', cwd, test_file]
  if jobs > 1:
    cmd[4:4] = ['-n', str(jobs)]
  if plugin:
    cmd[4:4] = ['-p', plugin]
  proc = run(cmd, cwd=cwd, env=base_env(pythonpath), check=False)
  if not os.path.exists(xml):
    raise CheckError(f'pytest wrote no report: {" ".join(cmd)}\n'
                     f'{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}')
  outcomes = {}
  for case in ET.parse(xml).getroot().iter('testcase'):
    key = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
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
  return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"


def failed(outcomes):
  return sorted(k for k, v in outcomes.items() if v == 'failed')


def git_apply(src, patch):
  """``git apply`` (no fuzz) of ``patch`` to the jax/ in ``src``."""
  env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(src))
  path = os.path.join(HERE, patch)
  for extra in (['--check'], []):
    proc = run(['git', 'apply', *extra, path], cwd=src, env=env, check=False)
    if proc.returncode != 0:
      raise CheckError(f'{patch} does not apply to {src}:\n{proc.stderr}')


def check_target(target, py, src, args, work, plugins, problems, timings):
  """Every step for one target (its jax/ in ``src``); returns its record."""
  peer_dir = os.path.join(args.peer, target.peer)
  if not os.path.exists(os.path.join(peer_dir, 'custom_api_test.py')):
    raise CheckError(f'{peer_dir}/custom_api_test.py is missing')
  path = [src]
  rec = dict(target=target.name, commit=target.commit, peer=peer_dir, steps={})

  def step(name, fn):
    t0 = time.monotonic()
    log(f'[{target.name}] {name} ...')
    out = fn()
    timings[f'{target.name}: {name}'] = round(time.monotonic() - t0, 1)
    return out

  def suite():
    return pytest(py, peer_dir, 'custom_api_test.py', args.jobs, path, work)

  def new_tests():
    return pytest(py, HERE, TEST_FILE, args.jobs, path, work)

  def launches(label):
    out = os.path.join(work, f'launches-{target.name}-{label}.json')
    proc = run([py, os.path.join(HERE, 'launches.py'), '--modes',
                'False,True' + (',policy' if label != 'unpatched' else ''),
                '--programs', args.launch_programs, '--json', out],
               env=base_env(path), check=False)
    if proc.returncode != 0 or not os.path.exists(out):
      problems.append(f'{target.name}/{label}: launches.py failed: '
                      f'{proc.stderr[-2000:]}')
      return
    with open(out) as f:
      cells = json.load(f)
    if args.launches:
      rec['steps'][label]['launches'] = proc.stdout
    key = lambda c: (c['program'], c['kernel'], c['policy'], c['jit'], c['mode'])
    got = {key(c): c['launches'] for c in cells}
    if label == 'unpatched':
      baseline.update(got)
      return
    changed = sorted(k for k, v in baseline.items() if got.get(k) != v)
    rec['steps'][label]['false_true_cells'] = (
        f'{len(baseline)} compared, {len(changed)} changed')
    if changed:
      problems.append(f'{target.name}/{label}: False/True launch cells changed: '
                      + '; '.join(f'{k}: {baseline[k]} -> {got.get(k)}'
                                  for k in changed))
    for k, v in got.items():
      if (k[0], k[2], k[4]) == ('const_in_fwd', 'dots', 'policy') and (
          v != 'f 1, fwd 1, bwd 1'):
        problems.append(f"{target.name}/{label}: an array constant in fwd under "
                        f"dots_saveable, 'policy' runs {v} ({k[1]}, {k[3]})")

  baseline = {}
  if args.jax_git:
    build = os.path.join(work, f'build-{target.name}')
    archive = subprocess.run(['git', '-C', args.jax_git, 'archive',
                              target.commit, 'tests/BUILD'],
                             capture_output=True, check=True).stdout
    os.makedirs(build)
    subprocess.run(['tar', '-x', '-C', build], input=archive, check=True)
    git_apply(build, BUILD_PATCH)
    rec['build_patch'] = 'applies'

  before = step('custom_api_test.py, unpatched', suite)
  rec['steps']['unpatched'] = dict(custom_api_test=tally(before),
                                   custom_api_test_failing=failed(before))
  new0 = step('new tests, unpatched', new_tests)
  rec['steps']['unpatched']['new_tests'] = tally(new0)
  launches('unpatched')

  for i, patch in enumerate(PATCHES):
    label = patch.split('-')[0]
    step(f'git apply {patch}', lambda: git_apply(src, patch))
    after = step(f'custom_api_test.py, {label}', suite)
    new = step(f'new tests, {label}', new_tests)
    regressions = sorted(k for k, v in after.items()
                         if v == 'failed' and before.get(k) == 'passed')
    missing = sorted(set(before) - set(after))
    rec['steps'][label] = dict(
        custom_api_test=tally(after), failing_only_patched=regressions,
        not_run_patched=missing, new_tests=tally(new),
        new_tests_failing=failed(new))
    if regressions or missing:
      problems.append(f'{target.name}/{label}: custom_api_test.py fails '
                      f'{regressions} and does not run {missing}')
    for cls in CLASSES[:i + 1]:
      bad = [k for k in failed(new) if k.startswith(cls + '::')]
      if bad:
        problems.append(f'{target.name}/{label}: {bad} fail')
    if i == 0:
      dropped = step('PR 1 tests, CustomVJPTraced.remat deleted',
                     lambda: pytest(py, HERE, f'{TEST_FILE}::{CLASSES[0]}',
                                    args.jobs, [*path, plugins], work,
                                    plugin='drop_custom_vjp_remat'))
      fails = sorted(k.split('::')[1] for k in failed(dropped))
      rec['steps'][label]['failing_without_remat_rule'] = fails
      if fails != sorted(NEEDS_REMAT_RULE):
        problems.append(f'{target.name}: with CustomVJPTraced.remat deleted, '
                        f'PR 1 tests fail {fails}, expected '
                        f'{sorted(NEEDS_REMAT_RULE)}')
    launches(label)

  if args.force_policy:
    forced = step("custom_api_test.py, 'policy' forced",
                  lambda: pytest(py, peer_dir, 'custom_api_test.py', args.jobs,
                                 [*path, plugins], work, plugin='force_policy'))
    regressions = sorted(k for k, v in forced.items()
                         if v == 'failed' and before.get(k) == 'passed')
    rec['steps']['forced'] = dict(custom_api_test=tally(forced),
                                  failing_only_forced=regressions)
    if regressions:
      problems.append(f"{target.name}: with 'policy' forced, {regressions} fail")
  return rec


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--peer', required=True,
                  help="folder with JAX's custom_api_test.py per commit "
                       '(jax-v0.11.0/, jax-main-2026-08-08/)')
  ap.add_argument('--jax-git', metavar='DIR',
                  help='a clone of jax-ml/jax: check the wheel against main '
                       f'{WHEEL.commit[:10]} and add the target main '
                       f'{MAIN.commit[:10]}')
  ap.add_argument('--json', help='write the results here')
  ap.add_argument('--jobs', type=int, default=2, help='pytest-xdist workers')
  ap.add_argument('--python', help=f'the Python {PYTHON} interpreter')
  ap.add_argument('--launches', action='store_true',
                  help="also print launches.py's tables at each step")
  ap.add_argument('--launch-programs', default='plain,uses_output,const_in_fwd',
                  help='programs for --launches (comma-separated)')
  ap.add_argument('--force-policy', action='store_true',
                  help="also run custom_api_test.py with optimize_remat='policy' "
                       'forced on every custom_vjp')
  ap.add_argument('--work', help='scratch folder (default: a new temporary '
                  'one, removed at the end)')
  args = ap.parse_args(argv)
  args.peer = os.path.abspath(args.peer)
  t_start = time.monotonic()
  work = args.work or tempfile.mkdtemp(prefix='upstream-check-')
  os.makedirs(work, exist_ok=True)
  result = dict(ok=False, targets=[], timings={}, problems=[])
  timings, problems = result['timings'], result['problems']
  try:
    if not os.path.isdir(args.peer):
      raise CheckError(f'--peer {args.peer} is not a folder')
    plugins = os.path.join(work, 'plugins')
    os.makedirs(plugins)
    for name, text in (('drop_custom_vjp_remat', DROP_REMAT_RULE),
                       ('force_policy', FORCE_POLICY)):
      with open(os.path.join(plugins, name + '.py'), 'w') as f:
        f.write(text)
    t0 = time.monotonic()
    log(f'installing jax and jaxlib {JAXLIB} (Python {PYTHON}) ...')
    py, wheel_jax = make_venv(find_python(args.python), work)
    timings['install'] = round(time.monotonic() - t0, 1)
    targets = [(WHEEL, wheel_jax)]
    if args.jax_git:
      differ, n = compare_wheel(wheel_jax, args.jax_git, work)
      result['wheel_vs_main'] = dict(commit=WHEEL.commit, wheel_files=n,
                                     differing=differ)
      if differ != ['jax/version.py']:
        problems.append(f'the wheel differs from {WHEEL.commit[:10]} in {differ}')
      main_src = os.path.join(work, 'main-source')
      git_archive(args.jax_git, MAIN.commit, main_src)
      targets.append((MAIN, os.path.join(main_src, 'jax')))
    for target, jax_dir in targets:
      src = os.path.join(work, f'src-{target.name}')
      shutil.copytree(jax_dir, os.path.join(src, 'jax'),
                      ignore=shutil.ignore_patterns('__pycache__'))
      result['targets'].append(check_target(target, py, src, args, work,
                                            plugins, problems, timings))
    result['ok'] = not problems
  except CheckError as e:
    result['error'] = str(e)
    log(f'ERROR: {e}')
  finally:
    if not args.work:
      shutil.rmtree(work, ignore_errors=True)
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  result['seconds'] = round(time.monotonic() - t_start, 1)
  result['cpu_seconds'] = dict(user=round(usage.ru_utime, 1),
                               system=round(usage.ru_stime, 1))

  if 'wheel_vs_main' in result:
    w = result['wheel_vs_main']
    log(f"\njax {JAXLIB} wheel vs main {w['commit'][:10]}: {w['wheel_files']} "
        f"files, differing: {', '.join(w['differing']) or 'none'}")
  for rec in result['targets']:
    log(f"\n=== {rec['target']}: main {rec['commit'][:10]}, JAX's tests from "
        f"{rec['peer']} ===")
    for label, s in rec['steps'].items():
      log(f'{label}: custom_api_test.py {s["custom_api_test"]}'
          + (f'; new tests {s["new_tests"]}' if 'new_tests' in s else ''))
      if s.get('failing_only_patched'):
        log(f'  failing only patched: {s["failing_only_patched"]}')
      if s.get('new_tests_failing'):
        log(f'  new tests failing: {", ".join(s["new_tests_failing"])}')
      if 'false_true_cells' in s:
        log(f'  launches.py False/True cells: {s["false_true_cells"]}')
      if 'failing_without_remat_rule' in s:
        log('  PR 1 tests failing with CustomVJPTraced.remat deleted: '
            + ', '.join(s['failing_without_remat_rule']))
      if s.get('launches'):
        log(s['launches'])
  for p in problems:
    log(f'PROBLEM: {p}')
  log('timings (s): ' + ', '.join(f'{k} {v}' for k, v in timings.items()))
  log(f"total {result['seconds']} s wall, CPU {result['cpu_seconds']['user']} s "
      f"user + {result['cpu_seconds']['system']} s system: "
      + ('OK' if result['ok'] else 'FAILED'))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(result, f, indent=1)
  return 0 if result['ok'] else 1


if __name__ == '__main__':
  sys.exit(main())
