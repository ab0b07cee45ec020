#!/usr/bin/env python3
"""Checks the patches of this folder against JAX's own tests and their own.

The target is JAX 0.12.1, the newest JAX reachable here: the ``jax==0.12.1``
wheel's ``jax/`` with jaxlib 0.12.1 from PyPI, on Python 3.12. JAX's
``custom_api_test.py`` is not in the wheel, and no 0.12.1 copy is reachable
here, so the newest one is run: ``--peer``'s ``jax-main-2026-08-08`` file,
where it lies.

The second target would be a ``main`` newer than that release. With
``--jax-git`` (a clone of JAX's repository), it asks whether that clone's
``main`` contains the commit the wheel was built from (``jax.version``'s
``_git_hash``): if not, it reports the ``main`` target as not reachable,
naming the newest ``main`` commit and its date; if so, that is a problem (the
series must be ported there and this script given the target), and it exits 1.
Without ``--jax-git`` it repeats what was found when last looked for.

With the target's ``jax/`` copied into a scratch folder on ``PYTHONPATH``:

1. unpatched: JAX's ``custom_api_test.py`` and the new test file, which is
   expected to fail there in part;
2. ``git apply`` PR 1: its test class must pass, and JAX's file must fail no
   test that passed unpatched;
3. ``git apply`` PR 2 on top: every new test must pass, JAX's file again fails
   no test that passed unpatched; PR 2's class runs once more with
   ``CustomVJPTraced.remat`` deleted and must then fail exactly where the
   policy keeps fwd's residual and the checkpoint does not short-circuit.

At each step ``launches.py`` counts the launches of the ``False`` and ``True``
rules: every ``False`` cell must be that of the unpatched step; a ``True``
cell may change only where the policy keeps every residual (names, offload),
and each change is listed. Every count table of ``../upstream.md`` and
``counts-jax-0.12.1.md`` (a table after ``<!-- counts: jax 0.12.1 -->``) is
compared cell by cell with what was measured.

It prints what failed where, pass counts and the time taken, writes them with
``--json``, and exits 0 only when every check holds. ``--force-true`` also
runs JAX's file with ``optimize_remat=True`` forced on every custom_vjp that
neither sets it nor asks for symbolic zeros, unpatched and patched, and
compares the two.

The full check takes about 10 minutes of CPU. Its result depends only on its
inputs: the files of this folder that it reads, the count tables' cells, JAX's
test file (and the peer folder's ``conftest.py``) and the installed wheel's
``jax/``. A full run that passes with ``--write-stamp`` writes their hash to
``check-stamp.json``. With ``--mode auto`` (the default, which CI uses) the
full check runs when the inputs' hash differs from the stamp's, and otherwise
the fast subset: the install, both patches applied (``git apply``, no fuzz),
the new tests with the series (every test must pass), the docs note's cell,
and the ``main`` report. ``--mode full`` and ``--mode fast`` choose.

Usage, from the repository root:
  python3 design/upstream/check.py --peer ../shared/peer
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
PATCHES = ('pr1-remat-kept-outputs.patch',
           'pr2-optimize_remat-follows-policy.patch')
BUILD_PATCH = 'tests-BUILD.patch'
TEST_FILE = 'custom_vjp_policy_test.py'
# The test class that comes with each patch, in TEST_FILE.
CLASSES = ('RematKeptOutputsTest', 'CustomVJPOptimizeRematPolicyTest')
PYTHON = '3.12'
JAXLIB = '0.12.1'
# PR 2's tests that must fail once CustomVJPTraced.remat is deleted: where
# the policy keeps fwd's residual (everything_saveable short-circuits the
# checkpoint in 0.12.1, so its cases pass either way), and the unnamed
# residual's, whose False half is that method's default rule (without it,
# False too runs f forward).
NEEDS_REMAT_RULE = tuple(f'test_{t}' for t in (
    'launches_unnamed_residual_names', 'launches_unnamed_residual_offload',
    'eager_launches_nondiff_arg', 'eager_launches_residual_name_saved',
    'eager_launches_residual_offloaded',
    'eager_launches_residual_offloaded_kept_kernel', 'eager_launches_vmap',
    'launches_kept_kernel_numpy_array_in_fwd',
    'launches_kept_kernel_residual_saved', 'launches_kept_kernel_scan',
    'launches_residual_name_saved', 'launches_residual_offloaded',
    'launches_residual_offloaded_kept_kernel',
    'launches_residual_saved_any_name_but_other',
    'launches_residual_saved_jnp_scalar_in_fwd',
    'launches_residual_saved_mask_in_fwd', 'launches_scan_residual_saved',
    'launches_vmap_residual_saved'))
# Policies of launches.py under which True may change: they keep fwd's
# residual.
KEEPING = ('names', 'offload')
PROGRAMS = ('plain,scan4,static,vmap_outside,vmap_inside,uses_output,cond,'
            'const_in_fwd,unnamed_res')
# Programs where a keeping policy does not keep every residual of fwd, so True
# keeps f forward: uses_output (the region reads F's output) and unnamed_res
# (a second residual, not named). In unnamed_res, True may run more launches
# than False (upstream.md says where); everywhere else it may not.
NOT_ALL_KEPT = ('uses_output', 'unnamed_res')
MORE_THAN_FALSE = ('unnamed_res',)
DOCS_NOTE = os.path.join(HERE, 'docs-note.md')
TABLES = (os.path.join(os.path.dirname(HERE), 'upstream.md'),
          os.path.join(HERE, 'counts-jax-0.12.1.md'))
STAMP = os.path.join(HERE, 'check-stamp.json')
# The files of this folder that the check reads (the tables are hashed by
# their cells, so that their prose may change without a full run).
INPUT_FILES = ('check.py', 'launches.py', *PATCHES, TEST_FILE, 'docs-note.md')


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  peer: str          # the folder of --peer with the test file run


RELEASE = Target('jax-0.12.1', 'jax-main-2026-08-08')

# A pytest plugin (on PYTHONPATH in a scratch folder) for the objection run.
DROP_REMAT_RULE = """\
from jax._src import hijax
del hijax.CustomVJPTraced.remat
"""

# A pytest plugin for --force-true: optimize_remat=True on every custom_vjp
# whose defvjp call sets neither optimize_remat nor symbolic_zeros (JAX
# refuses the two together, by design).
FORCE_TRUE = """\
from jax._src import custom_derivatives, hijax

def _forcing(defvjp):
  def forced(self, fwd, bwd, *args, **kwargs):
    if (not args and 'optimize_remat' not in kwargs
        and not kwargs.get('symbolic_zeros')):
      kwargs['optimize_remat'] = True
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
  """A virtualenv with jax and jaxlib 0.12.1 and the test tools from PyPI;
  returns (its python, the installed jax/ folder)."""
  venv = os.path.join(work, 'venv')
  run([python, '-m', 'venv', venv])
  py = os.path.join(venv, 'bin', 'python')
  run([py, '-m', 'pip', 'install', '-q', '--disable-pip-version-check',
       f'jax=={JAXLIB}', f'jaxlib=={JAXLIB}', 'absl-py', 'pytest',
       'pytest-xdist'])
  out = run([py, '-c', 'import os, jax, jaxlib; print(os.path.dirname('
             'jax.__file__)); print(jax.__version__, jaxlib.__version__); '
             'print(jax.version._git_hash)'],
            env=base_env(None)).stdout.split('\n')
  if out[1].split() != [JAXLIB, JAXLIB]:
    raise CheckError(f'installed jax/jaxlib {out[1]}, wanted {JAXLIB}')
  return py, out[0], out[2].strip()


def main_target(git_dir, release_commit):
  """Whether a ``main`` newer than the release is reachable in ``git_dir``:
  returns ``(newer, what was found)``. Newer means main's history holds the
  commit the release wheel was built from."""
  if not git_dir:
    return False, ('not reachable when last looked for (2026-12-06: the newest '
                   'main was cec06d116c, 2026-08-08, older than '
                   f'{JAXLIB}); --jax-git looks again')
  git = lambda *a: run(['git', '--git-dir', git_dir, *a], check=False)
  head = git('log', '-1', '--format=%H %cI', 'refs/heads/main')
  if head.returncode != 0:
    raise CheckError(f'--jax-git {git_dir}: no refs/heads/main\n{head.stderr}')
  commit, date = head.stdout.split()
  if git('cat-file', '-e', f'{release_commit}^{{commit}}').returncode == 0 and (
      git('merge-base', '--is-ancestor', release_commit, commit).returncode == 0):
    return True, (f'main {commit[:10]} ({date}) contains {JAXLIB}\'s commit '
                  f'{release_commit[:10]}')
  return False, (f'not reachable: the newest main in {git_dir} is '
                 f'{commit[:10]} ({date}), which does not contain the commit '
                 f'{JAXLIB} was built from ({release_commit[:10]}); the series '
                 f'targets {JAXLIB} only')


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


KERNEL_NAMES = {'callback': 'callback', 'never removed': 'never_dce'}
POLICY_NAMES = {'none': 'nothing', 'dots': 'dots', 'everything': 'everything',
                'names': 'names', 'offload': 'offload'}
# A table's value columns: the step and mode each was measured at.
COLUMNS = {'False': ('unpatched', 'False'), 'True': ('unpatched', 'True'),
           'True, the series': ('pr2', 'True')}


def launch_total(cell):
  """Launches in a cell ('f 1, fwd 1, bwd 1' -> 3); an error counts as
  none, so that a cell that raises never passes for a cheaper one."""
  counts = re.findall(r'\b\w+ (\d+)', cell)
  return sum(map(int, counts)) if counts else float('inf')


# What fwd names its residual with in a table: checkpoint_name, or
# checkpoint_name_fwd after ``<!-- counts: jax 0.12.1, checkpoint_name_fwd -->``.
NAME_FWD = 'checkpoint_name_fwd'
MARKER = re.compile(rf'<!-- counts: jax 0\.12\.1(, {NAME_FWD})? -->')


def table_cells(path):
  """The cells of every count table in ``path``: a markdown table after a
  line ``<!-- counts: jax 0.12.1 -->`` (or ``<!-- counts: jax 0.12.1,
  checkpoint_name_fwd -->`` where fwd names its residual with that), whose
  key columns (program, kernel, policy, run) may list several values
  separated by commas. Returns ``{(program, kernel, policy, run, column):
  launches}``, the column prefixed with ``checkpoint_name_fwd:`` in the
  second kind of table."""
  cells, lines = {}, open(path).read().splitlines()
  clean = lambda c: c.strip().strip('*`').replace('`', '').strip()
  for n, line in enumerate(lines):
    marker = MARKER.fullmatch(line.strip())
    if not marker:
      continue
    prefix = f'{NAME_FWD}:' if marker.group(1) else ''
    head = [clean(c) for c in lines[n + 1].strip().strip('|').split('|')]
    for row in lines[n + 3:]:
      if not row.startswith('|'):
        break
      vals = dict(zip(head, (c.strip() for c in row.strip().strip('|').split('|'))))
      keys = [[clean(v) for v in vals[k].split(',')] for k in
              ('program', 'kernel', 'policy', 'run')]
      for prog in keys[0]:
        for kernel in keys[1]:
          for policy in keys[2]:
            for run in keys[3]:
              for col in COLUMNS:
                if col in vals:
                  cells[(prog, KERNEL_NAMES[kernel], POLICY_NAMES[policy], run,
                         prefix + col)] = clean(vals[col])
  return cells


def check_tables(measured, problems):
  """Compares every table cell with ``measured[(step, mode)][key]``."""
  n = 0
  for path in TABLES:
    for (prog, kernel, policy, run, col), want in table_cells(path).items():
      namer, _, col = col.rpartition(':')
      step, mode = COLUMNS[col]
      step = f'{step}:{namer}' if namer else step
      got = measured.get(step, {}).get((prog, kernel, policy, run, mode))
      n += 1
      if got != want:
        problems.append(f'{os.path.basename(path)}: {prog}/{kernel}/{policy}/'
                        f'{run}, {col}: the table says {want!r}, measured {got!r}')
  return n


def inputs_hash(wheel_jax, peer_dir):
  """sha256 of everything the full check's result depends on: INPUT_FILES,
  the count tables' cells, JAX's test file and the peer folder's
  ``conftest.py``, and every file of the installed ``jax/`` (the wheel the
  patches apply to)."""
  h = hashlib.sha256()
  def add(label, data):
    h.update(f'{label}\0{len(data)}\0'.encode())
    h.update(data)
  for name in INPUT_FILES:
    with open(os.path.join(HERE, name), 'rb') as f:
      add(name, f.read())
  for path in TABLES:
    cells = sorted(table_cells(path).items())
    add(os.path.basename(path), json.dumps(cells).encode())
  for path in (os.path.join(peer_dir, 'custom_api_test.py'),
               os.path.join(os.path.dirname(peer_dir), 'conftest.py')):
    if os.path.exists(path):
      with open(path, 'rb') as f:
        add(os.path.relpath(path, os.path.dirname(peer_dir)), f.read())
  for root, dirs, files in os.walk(wheel_jax):
    dirs[:] = sorted(d for d in dirs if d != '__pycache__')
    for name in sorted(files):
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        add('jax/' + os.path.relpath(path, wheel_jax), f.read())
  return h.hexdigest()


def read_stamp():
  try:
    with open(STAMP) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def check_docs_note(py, path, work, problems):
  """Runs the docs note's cell (after the page's own imports) and compares
  what it prints with the ``# {...}`` comments of its print lines."""
  text = open(DOCS_NOTE).read()
  cell, = re.findall(r'```\{code-cell\}\n(.*?)```', text, re.S)
  want = re.findall(r'^print\(.*# (\{.*\})$', cell, re.M)
  script = os.path.join(work, 'docs_note_cell.py')
  with open(script, 'w') as f:
    f.write('import jax\nimport jax.numpy as jnp\n'
            'from jax.ad_checkpoint import checkpoint_name\n' + cell)
  proc = run([py, script], env=base_env(path), check=False)
  got = proc.stdout.splitlines()
  if proc.returncode != 0 or got != want:
    problems.append(f'docs-note.md: its cell prints {got}, its comments say '
                    f'{want} ({proc.stderr[-1000:]})')
  return got


def check_target(target, py, src, args, work, plugins, problems, timings):
  """Every step for one target (its jax/ in ``src``); returns its record."""
  peer_dir = os.path.join(args.peer, target.peer)
  if not os.path.exists(os.path.join(peer_dir, 'custom_api_test.py')):
    raise CheckError(f'{peer_dir}/custom_api_test.py is missing')
  path = [src]
  rec = dict(target=target.name, peer=peer_dir, steps={})
  measured = {}

  def step(name, fn):
    t0 = time.monotonic()
    log(f'[{target.name}] {name} ...')
    out = fn()
    timings[f'{target.name}: {name}'] = round(time.monotonic() - t0, 1)
    return out

  def suite(plugin=None):
    return pytest(py, peer_dir, 'custom_api_test.py', args.jobs,
                  [*path, plugins] if plugin else path, work, plugin=plugin)

  def new_tests():
    return pytest(py, HERE, TEST_FILE, args.jobs, path, work)

  def launches_name_fwd(label):
    # fwd naming its residual with checkpoint_name_fwd: measured for the
    # tables that compare it with the series.
    out = os.path.join(work, f'launches-{target.name}-{label}-{NAME_FWD}.json')
    proc = run([py, os.path.join(HERE, 'launches.py'), '--modes', 'False,True',
                '--programs', PROGRAMS, '--name', NAME_FWD, '--json', out],
               env=base_env(path), check=False)
    if proc.returncode != 0 or not os.path.exists(out):
      problems.append(f'{target.name}/{label}: launches.py --name {NAME_FWD} '
                      f'failed: {proc.stderr[-2000:]}')
      return
    with open(out) as f:
      got = measured[f'{label}:{NAME_FWD}'] = {
          (c['program'], c['kernel'], c['policy'], c['jit'], c['mode']):
          c['launches'] for c in json.load(f)}
    if label != 'unpatched':  # the series changes no False cell here either
      base = measured[f'unpatched:{NAME_FWD}']
      changed = sorted(k for k, v in base.items() if got.get(k) != v)
      rec['steps'][label][f'{NAME_FWD}_cells'] = (
          f'{len(base)} compared, {len(changed)} changed, '
          f'{sum(k[4] == "False" for k in changed)} of them False')
      if any(k[4] == 'False' for k in changed):
        problems.append(f'{target.name}/{label}: with {NAME_FWD}, False cells '
                        'changed: ' + '; '.join(
                            f'{k}: {base[k]} -> {got.get(k)}'
                            for k in changed if k[4] == 'False'))

  def launches(label):
    out = os.path.join(work, f'launches-{target.name}-{label}.json')
    proc = run([py, os.path.join(HERE, 'launches.py'), '--modes', 'False,True',
                '--programs', PROGRAMS, '--json', out],
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
    got = measured[label] = {key(c): c['launches'] for c in cells}
    if label == 'unpatched':
      return
    base = measured['unpatched']
    changed = sorted(k for k, v in base.items() if got.get(k) != v)
    allowed = [k for k in changed if k[4] == 'True' and k[2] in KEEPING]
    rec['steps'][label]['false_true_cells'] = (
        f'{len(base)} compared, {len(changed)} changed')
    rec['steps'][label]['changed'] = [
        f'{"/".join(k)}: {base[k]} -> {got.get(k)}' for k in changed]
    wrong = [k for k in changed if k not in allowed or label == 'pr1']
    if wrong:
      problems.append(f'{target.name}/{label}: launch cells changed: '
                      + '; '.join(f'{k}: {base[k]} -> {got.get(k)}'
                                  for k in wrong))
    if label == 'pr2':
      # upstream.md: never more than unpatched True; never more than False
      # except in MORE_THAN_FALSE, where each such cell is listed.
      more = rec['steps'][label]['more_than_false'] = []
      for k, v in got.items():
        if k[4] != 'True':
          continue
        than_false = launch_total(v) > launch_total(base[(*k[:4], 'False')])
        if than_false:
          more.append(f'{"/".join(k[:4])}: {v} (False: '
                      f"{base[(*k[:4], 'False')]})")
        if launch_total(v) > launch_total(base[k]) or (
            than_false and k[0] not in MORE_THAN_FALSE):
          problems.append(f'{target.name}: {k[:4]}: the series runs {v}, more '
                          f"than False ({base[(*k[:4], 'False')]}) or True "
                          f"({base[k]})")
        if k[2] in KEEPING and k[0] not in NOT_ALL_KEPT and (
            'f ' in v.replace('fwd', '')):
          problems.append(f'{target.name}: True still runs f where the policy '
                          f'keeps the residual: {k}: {v}')

  before = step('custom_api_test.py, unpatched', suite)
  rec['steps']['unpatched'] = dict(custom_api_test=tally(before),
                                   custom_api_test_failing=failed(before))
  new0 = step('new tests, unpatched', new_tests)
  rec['steps']['unpatched']['new_tests'] = tally(new0)
  step('launches, unpatched', lambda: launches('unpatched'))
  step(f'launches, {NAME_FWD}, unpatched',
       lambda: launches_name_fwd('unpatched'))
  if args.force_true:
    forced0 = step('custom_api_test.py, True forced, unpatched',
                   lambda: suite('force_true'))

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
    if i == 1:
      dropped = step('PR 2 tests, CustomVJPTraced.remat deleted',
                     lambda: pytest(py, HERE, f'{TEST_FILE}::{CLASSES[1]}',
                                    args.jobs, [*path, plugins], work,
                                    plugin='drop_custom_vjp_remat'))
      fails = sorted(k.split('::')[1] for k in failed(dropped))
      rec['steps'][label]['failing_without_remat_rule'] = fails
      if fails != sorted(NEEDS_REMAT_RULE):
        problems.append(f'{target.name}: with CustomVJPTraced.remat deleted, '
                        f'PR 2 tests fail {fails}, expected '
                        f'{sorted(NEEDS_REMAT_RULE)}')
    step(f'launches, {label}', lambda: launches(label))
    if label == 'pr2':
      step(f'launches, {NAME_FWD}, {label}', lambda: launches_name_fwd(label))
  rec['docs_note'] = step('docs note cell, the series',
                          lambda: check_docs_note(py, path, work, problems))

  if args.force_true:
    forced = step('custom_api_test.py, True forced, the series',
                  lambda: suite('force_true'))
    regressions = sorted(k for k, v in forced.items()
                         if v == 'failed' and forced0.get(k) == 'passed')
    rec['steps']['forced'] = dict(
        custom_api_test=f'{tally(forced0)} unpatched; {tally(forced)} patched',
        failing_only_forced=regressions)
    if regressions:
      problems.append(f'{target.name}: with True forced, {regressions} fail '
                      'patched only')
  n = check_tables(measured, problems)
  rec['table_cells'] = f'{n} table cells compared'
  return rec


def fast_target(target, py, src, work, jobs, problems, timings):
  """The fast subset, for inputs a full run has passed with (the stamp): both
  patches apply, every new test passes with the series, and the docs note's
  cell prints what its comments say."""
  path = [src]
  rec = dict(target=target.name, peer=os.path.join('(fast)', target.peer),
             steps={})
  def step(name, fn):
    t0 = time.monotonic()
    log(f'[{target.name}] {name} ...')
    out = fn()
    timings[f'{target.name}: {name}'] = round(time.monotonic() - t0, 1)
    return out
  for patch in PATCHES:
    step(f'git apply {patch}', lambda: git_apply(src, patch))
  new = step('new tests, the series',
             lambda: pytest(py, HERE, TEST_FILE, jobs, path, work))
  rec['steps']['the series'] = dict(new_tests=tally(new),
                                    new_tests_failing=failed(new))
  if failed(new):
    problems.append(f'{target.name}/the series: {failed(new)} fail')
  rec['docs_note'] = step('docs note cell, the series',
                          lambda: check_docs_note(py, path, work, problems))
  return rec


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--peer', required=True,
                  help="folder with JAX's custom_api_test.py per commit "
                       f'({RELEASE.peer}/)')
  ap.add_argument('--json', help='write the results here')
  ap.add_argument('--jobs', type=int, default=2, help='pytest-xdist workers')
  ap.add_argument('--python', help=f'the Python {PYTHON} interpreter')
  ap.add_argument('--launches', action='store_true',
                  help="also print launches.py's tables at each step")
  ap.add_argument('--force-true', action='store_true',
                  help='also run custom_api_test.py with optimize_remat=True '
                       'forced on every custom_vjp, unpatched and patched')
  ap.add_argument('--jax-git', help="a clone of JAX's repository (its git "
                  'folder), to look for a main newer than the release')
  ap.add_argument('--work', help='scratch folder (default: a new temporary '
                  'one, removed at the end)')
  ap.add_argument('--mode', choices=('auto', 'full', 'fast'), default='auto',
                  help='full: every step; fast: the subset (patches apply, '
                  'new tests pass with the series, docs note cell); auto '
                  '(default): full unless the inputs hash to '
                  f'{os.path.basename(STAMP)}\'s')
  ap.add_argument('--write-stamp', action='store_true',
                  help=f'after a full run that passes, write '
                  f'{os.path.basename(STAMP)} (the inputs\' hash)')
  args = ap.parse_args(argv)
  args.peer = os.path.abspath(args.peer)
  t_start = time.monotonic()
  work = args.work or tempfile.mkdtemp(prefix='upstream-check-')
  os.makedirs(work, exist_ok=True)
  result = dict(ok=False, targets=[], main=None, timings={}, problems=[])
  timings, problems = result['timings'], result['problems']
  try:
    if not os.path.isdir(args.peer):
      raise CheckError(f'--peer {args.peer} is not a folder')
    plugins = os.path.join(work, 'plugins')
    os.makedirs(plugins)
    for name, text in (('drop_custom_vjp_remat', DROP_REMAT_RULE),
                       ('force_true', FORCE_TRUE)):
      with open(os.path.join(plugins, name + '.py'), 'w') as f:
        f.write(text)
    t0 = time.monotonic()
    log(f'installing jax and jaxlib {JAXLIB} (Python {PYTHON}) ...')
    py, wheel_jax, release_commit = make_venv(find_python(args.python), work)
    timings['install'] = round(time.monotonic() - t0, 1)
    newer, result['main'] = main_target(args.jax_git, release_commit)
    log(f'[main] {result["main"]}')
    if newer:
      problems.append(f'{result["main"]}: a main newer than {JAXLIB} is '
                      'reachable; port the series and add it as a target')
    src = os.path.join(work, f'src-{RELEASE.name}')
    shutil.copytree(wheel_jax, os.path.join(src, 'jax'),
                    ignore=shutil.ignore_patterns('__pycache__'))
    result['inputs'] = inputs_hash(wheel_jax, os.path.join(args.peer,
                                                           RELEASE.peer))
    stamp = read_stamp()
    mode = args.mode
    if mode == 'auto':
      mode = 'fast' if stamp.get('inputs') == result['inputs'] else 'full'
    result['mode'] = mode
    log(f'[inputs] sha256 {result["inputs"][:16]}; the stamp\'s '
        f'{stamp.get("inputs", "(none)")[:16]}: the {mode} check')
    if mode == 'fast':
      result['targets'].append(fast_target(RELEASE, py, src, work, args.jobs,
                                           problems, timings))
    else:
      result['targets'].append(check_target(RELEASE, py, src, args, work,
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

  for rec in result['targets']:
    log(f"\n=== {rec['target']}, JAX's tests from {rec['peer']} ===")
    for label, s in rec['steps'].items():
      log(f'{label}: '
          + '; '.join(f'{what} {s[key]}' for what, key in (
              ('custom_api_test.py', 'custom_api_test'),
              ('new tests', 'new_tests')) if key in s))
      if s.get('failing_only_patched'):
        log(f'  failing only patched: {s["failing_only_patched"]}')
      if s.get('failing_only_forced'):
        log(f'  failing only patched, True forced: {s["failing_only_forced"]}')
      if s.get('new_tests_failing'):
        log(f'  new tests failing: {", ".join(s["new_tests_failing"])}')
      if 'false_true_cells' in s:
        log(f'  launches.py False/True cells: {s["false_true_cells"]}')
      if f'{NAME_FWD}_cells' in s:
        log(f'  launches.py --name {NAME_FWD}: {s[f"{NAME_FWD}_cells"]}')
        for c in s['changed']:
          log(f'    {c}')
      for c in s.get('more_than_false', ()):
        log(f'    more launches than False (allowed only in '
            f'{", ".join(MORE_THAN_FALSE)}): {c}')
      if 'failing_without_remat_rule' in s:
        log('  PR 2 tests failing with CustomVJPTraced.remat deleted: '
            + ', '.join(s['failing_without_remat_rule']))
      if s.get('launches'):
        log(s['launches'])
    log(rec.get('table_cells', ''))
  log(f"\n=== main: {result.get('main', 'not looked for')} ===")
  for p in problems:
    log(f'PROBLEM: {p}')
  log('timings (s): ' + ', '.join(f'{k} {v}' for k, v in timings.items()))
  log(f"total {result['seconds']} s wall, CPU {result['cpu_seconds']['user']} s "
      f"user + {result['cpu_seconds']['system']} s system: "
      + ('OK' if result['ok'] else 'FAILED'))
  if result.get('mode'):
    log(f"the {result['mode']} check; inputs sha256 {result['inputs']}")
  if args.write_stamp:
    if result['ok'] and result.get('mode') == 'full':
      with open(STAMP, 'w') as f:
        json.dump(dict(inputs=result['inputs'],
                       written=time.strftime('%Y-%m-%d %H:%M UTC',
                                             time.gmtime()),
                       seconds=result['seconds'],
                       cpu_seconds=result['cpu_seconds']), f, indent=1)
        f.write('\n')
      log(f'wrote {STAMP}')
    else:
      log(f'{os.path.basename(STAMP)} not written: only a full run that '
          'passes writes it')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(result, f, indent=1)
  return 0 if result['ok'] else 1


if __name__ == '__main__':
  sys.exit(main())
