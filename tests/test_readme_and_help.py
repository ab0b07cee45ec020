"""What a newcomer reads first runs as written: the README's usage snippet,
the runnable examples in the public docstrings, and ``help()`` pages without
inherited boilerplate."""

import ast
import os
import pydoc
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartvjp
from smartvjp import smart_custom_vjp

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def readme_section(title):
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end if end != -1 else len(text)]


def usage_snippet():
  blocks = re.findall(r"```python\n(.*?)```", readme_section("Usage"), re.S)
  assert len(blocks) == 1, "the Usage section should hold one python block"
  return blocks[0]


def docstring_example(doc):
  """The docstring's one fenced ``python`` example, dedented."""
  blocks = re.findall(r"^( *)```python\n(.*?)^\1```", doc, re.S | re.M)
  assert len(blocks) == 1, "one python example per docstring"
  return textwrap.dedent(blocks[0][1])


def same_rules_under_custom_vjp(ns):
  """``jax.custom_vjp`` with the snippet's ``f``, ``f_fwd`` and ``f_bwd``."""
  g = jax.custom_vjp(ns["f"].fun)
  g.defvjp(ns["f_fwd"], ns["f_bwd"])
  return g


def check_against_custom_vjp_and_plain(ns, plain):
  x, w, dx, dw = ns["x"], ns["w"], ns["dx"], ns["dw"]
  loss = lambda F: (lambda x, w: jnp.sum(jax.checkpoint(F)(x, w) ** 2))
  anchor = jax.jit(jax.grad(loss(same_rules_under_custom_vjp(ns)), (0, 1)))(x, w)
  reference = jax.grad(loss(plain), (0, 1))(x, w)
  for got, a, r in zip((dx, dw), anchor, reference):
    assert got.shape == r.shape and bool(jnp.any(r != 0))
    np.testing.assert_allclose(got, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, r, rtol=1e-5, atol=1e-6)


def test_readme_usage_snippet_runs_and_matches_custom_vjp(capsys):
  ns = {}
  exec(compile(usage_snippet(), "README.md (Usage)", "exec"), ns)
  check_against_custom_vjp_and_plain(ns, lambda x, w: jax.nn.gelu(x @ w))
  # what it prints (smartvjp.print_schedule) is its closing comments: f
  # forward, f_fwd_bwd inside the rematerialized region, f_fwd nowhere
  printed = capsys.readouterr().out.splitlines()
  claimed = usage_snippet().split("# the schedule")[1].splitlines()[3:]
  assert len(printed) == len(claimed) == 2, (printed, claimed)
  for line, comment in zip(printed, claimed):
    assert comment.startswith("# " + line + "  "), (line, comment)
  assert printed == ["f (f) of f  in top level",
                     "fwd_bwd (f_fwd_bwd) of f  in remat2"]
  assert "forward pass: f" in claimed[0] and "backward: f_fwd_bwd" in claimed[1]


def test_smart_custom_vjp_docstring_example():
  code = docstring_example(smart_custom_vjp.__doc__)
  assert "jax.checkpoint" in code and "jax.grad" in code
  ns = {}
  exec(compile(code, "smart_custom_vjp.__doc__", "exec"), ns)
  check_against_custom_vjp_and_plain(ns, lambda x, w: jnp.tanh(x @ w))


def test_filter_custom_vjp_docstring_example():
  eqx = pytest.importorskip("equinox")
  code = docstring_example(smartvjp.filter_custom_vjp.__doc__)
  ns = {}
  exec(compile(code, "filter_custom_vjp.__doc__", "exec"), ns)
  layer, x = ns["layer"], ns["x"]
  want = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(layer.w)
  assert isinstance(ns["grads"], ns["Linear"])
  np.testing.assert_allclose(ns["grads"].w, want, rtol=1e-5, atol=1e-6)
  # equinox's own filter_custom_vjp with the same rules agrees
  ref = eqx.filter_custom_vjp(ns["apply"].fn)
  ref.def_fwd(ns["apply"].fn_fwd)
  ref.def_bwd(ns["apply"].fn_bwd)
  theirs = eqx.filter_grad(
      lambda l: jnp.sum(jax.checkpoint(ref)(l, x) ** 2))(layer)
  np.testing.assert_allclose(ns["grads"].w, theirs.w, rtol=1e-5, atol=1e-6)


def test_check_primals_docstring_example_warns():
  code = docstring_example(smartvjp.check_primals.__doc__)
  ns = {}
  exec(compile(code, "check_primals.__doc__", "exec"), ns)
  assert [w.category for w in ns["caught"]] == [RuntimeWarning]


def test_docstrings_do_not_send_readers_to_missing_files():
  # an installed package has no README.md or design/ next to it
  for obj in (smart_custom_vjp, smartvjp.filter_custom_vjp,
              smartvjp.check_primals, smartvjp):
    doc = obj.__doc__
    assert "``README.md``" not in doc and "(``design/``)" not in doc
    for name in re.findall(r"design/\w+\.md", doc):
      assert "source repository" in doc, name


@pytest.mark.parametrize("obj", [smart_custom_vjp, smartvjp.filter_custom_vjp,
                                 smartvjp.check_primals],
                         ids=lambda o: o.__name__)
def test_help_has_no_inherited_boilerplate(obj):
  text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
  for noise in ("typing.Generic", "__class_getitem__", "__orig_bases__",
                "__parameters__", "Parameterizes a generic class",
                "Call self as a function", "Initialize self"):
    assert noise not in text, noise
  assert obj.__call__.__doc__ and len(obj.__call__.__doc__.split()) > 10
  assert "Returns" in obj.__call__.__doc__


def test_call_docstrings_say_what_they_raise():
  for obj in (smart_custom_vjp, smartvjp.filter_custom_vjp):
    doc = obj.__call__.__doc__
    assert "Args:" in doc and "Returns:" in doc and "Raises:" in doc


def test_setup_commands_reuse_one_venv():
  blocks = re.findall(r"```bash\n(.*?)```", readme_section("Set up on a fresh machine"),
                      re.S)
  assert len(blocks) == 2
  demo, tests = (b.strip() for b in blocks)
  for command in (demo, tests):
    assert command.startswith("test -d .venv || python3 -m venv .venv && "
                              ". .venv/bin/activate && pip install -e ")
  assert demo.endswith("python examples/seed_remat.py")
  assert tests.endswith('pip install -e ".[test]" && python -m pytest -n auto')


def test_readme_is_short_and_its_links_resolve():
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  # 1800 again since issue 70 (the performance tables moved to docs/)
  assert len(text.split()) <= 1800, "the README is a summary; details go to docs/"
  targets = re.findall(r"\]\(([^)\s]+)\)", text)
  local = [t for t in targets if not t.startswith(("http://", "https://"))]
  assert local, "the README links into the docs"
  for target in local:
    assert os.path.exists(os.path.join(ROOT, target.split("#")[0])), target
  # no placeholder left where a measured figure belongs
  for line in text.splitlines():
    assert not re.fullmatch(r"[A-Z][A-Z_]{2,}", line.strip()), line
  assert not re.search(r"\b(TODO|TBD|FIXME|XXX|COMMIT|PERF|[A-Z]{2,}_[A-Z_]{2,})\b",
                       text)
  # the two seed reports are linked by address
  for seed in ("https://github.com/jax-ml/jax/issues/21303",
               "https://github.com/pasteurlabs/tesseract-jax/issues/27"):
    assert seed in targets, seed


# -- every command the README prints runs as printed -----------------------------

# Each command the README prints, and the test that runs it (its smoke sizes
# where it needs hardware or an hour). The two set-up commands run in CI
# (.ci/run runs the test command) and in each release's fresh-clone trial.
EXAMPLES = "tests/test_examples.py::test_readme_example_command"
README_COMMANDS = {
    'test -d .venv || python3 -m venv .venv && . .venv/bin/activate && pip '
    'install -e ".[examples]" && python examples/seed_remat.py':
        "tests/test_examples.py::test_seed_remat_table",
    'test -d .venv || python3 -m venv .venv && . .venv/bin/activate && pip '
    'install -e ".[test]" && python -m pytest -n auto':
        "tests/test_readme_and_help.py::test_setup_commands_reuse_one_venv",
    "python benchmarks/counts.py":
        "tests/test_examples.py::test_counts_benchmark_smartvjp_column",
    "python benchmarks/cost.py":
        "tests/test_cost.py::test_the_printed_goals_are_met_and_the_kernel_flops_say_na",
    "python tools/tpu_session.py":
        "tests/test_readme_and_help.py::test_tpu_session_runs_as_printed",
    # the wheel, built and installed from outside the clone by
    # tools/release_check.sh, which CI runs
    "pip install .":
        "tests/test_release.py::test_release_check_script_is_executable",
    "pip install /path/to/smartvjp":
        "tests/test_release.py::test_release_check_script_is_executable",
    'pip install -e ".[docs]" && mkdocs serve':
        "tests/test_docs.py::test_mkdocs_build_strict",
}


def readme_commands() -> list[str]:
  """The commands the README prints: its bash blocks and the code spans
  that start with ``python `` or ``pip ``."""
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  found = [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]
  prose = re.sub(r"```.*?```", "", text, flags=re.S)
  found += [c for c in re.findall(r"`([^`\n]+)`", prose)
            if c.startswith(("python ", "pip "))]
  return list(dict.fromkeys(found))


def _required_options(script: str) -> list[str]:
  """The ``add_argument(..., required=True)`` options and positional
  arguments without a default of a script: a command that names none of
  them exits with a usage error."""
  tree = ast.parse(open(os.path.join(ROOT, script), encoding="utf-8").read())
  required = []
  for node in ast.walk(tree):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument" and node.args
        and isinstance(node.args[0], ast.Constant)):
      kw = {k.arg: k.value for k in node.keywords}
      flag = node.args[0].value
      nargs = getattr(kw.get("nargs"), "value", None)
      if (getattr(kw.get("required"), "value", False)
          or (not flag.startswith("-") and nargs not in ("?", "*")
              and "default" not in kw)):
        required.append(flag)
  return required


def test_every_command_the_readme_prints_runs_as_printed():
  import test_examples
  commands = readme_commands()
  mapped = dict(README_COMMANDS, **{c: EXAMPLES for c in test_examples.COMMANDS})
  assert sorted(commands) == sorted(mapped), (
      "each command the README prints needs a test that runs it: "
      f"{sorted(set(commands) ^ set(mapped))}")
  for command, test in mapped.items():
    file, _, name = test.partition("::")
    source = open(os.path.join(ROOT, file), encoding="utf-8").read()
    assert re.search(rf"^def {name}\(", source, re.M), test
    for part in command.split("&&"):
      words = part.split()
      if words[:1] == ["python"] and words[1].endswith(".py"):
        script = words[1]
        assert os.path.isfile(os.path.join(ROOT, script)), script
        assert not _required_options(script), (
            f"{command}: {script} requires {_required_options(script)}")
        stem = os.path.splitext(os.path.basename(script))[0]
        assert stem in source or test == EXAMPLES, (test, script)


def test_required_options_are_found():
  # tools/tpu_session.py required --out until issue 58
  tree = 'p.add_argument("--out", required=True)\np.add_argument("n")\n'
  path = os.path.join(ROOT, "tests", "_required_probe.py")
  try:
    open(path, "w").write(tree)
    assert _required_options("tests/_required_probe.py") == ["--out", "n"]
  finally:
    os.remove(path)


def test_tpu_session_runs_as_printed():
  """``python tools/tpu_session.py``, as the README prints it: off a TPU it
  says it measured nothing and exits 0 (on a TPU it measures: by hand)."""
  if jax.default_backend() == "tpu":
    pytest.skip("on a TPU it runs the measurements (minutes): by hand")
  done = subprocess.run([sys.executable, "tools/tpu_session.py"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "no TPU here" in done.stdout and "nothing ran" in done.stdout


# -- what is supported, what pip installs, what CI tests ------------------------

def ci_legs():
  """``(whole-suite legs [(python, "0.Y.x")], probe releases)`` of .ci/run."""
  text = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
  suites = re.findall(r'^(?:\w+=\w+ )?suite \S+ (3\.\d+) "jax>=(0\.\d+),', text,
                      re.M)
  probes = re.findall(r"^short \S+ 3\.\d+ (0\.\d+\.\d+)$", text, re.M)
  return [(py, f"{jax_}.x") for py, jax_ in suites], probes


def test_supported_line_says_what_ci_tests_and_what_pip_installs():
  """Issue 58: the README said "3.12 with 0.11.x" where pip gives a 3.12
  user jax 0.12. The line names exactly the legs of .ci/run, and what pip
  installs per Python: jax from 0.11 needs Python 3.12 (its metadata), so
  3.11 gets 0.10.2 and 3.12/3.13 the newest 0.12.x pyproject allows."""
  import importlib.metadata
  import tomllib
  line = next(l for l in open(os.path.join(ROOT, "README.md"),
                              encoding="utf-8").read().splitlines()
              if l.startswith("**Supported**"))
  suites, probes = ci_legs()
  assert [py for py, _ in suites] == ["3.11", "3.12", "3.13"]
  assert ("CI (`.ci/run`) runs the whole suite on " + ", ".join(
      f"{py} with {v}" for py, v in suites)) in line
  assert probes and "version probes" in line
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
    deps = tomllib.load(fh)["project"]["dependencies"]
  upper = re.search(r"jax>=0\.(\d+)[.\d]*,<0\.(\d+)", " ".join(deps))
  lo, hi = int(upper.group(1)), int(upper.group(2))
  assert f"jax/jaxlib 0.{lo}.x to 0.{hi - 1}.x" in line
  assert f"3.11 gets jax 0.{lo}.2" in line
  assert f"3.12 and 3.13 the newest 0.{hi - 1}.x" in line
  # pip's choice, from the installed JAX's own metadata
  installed = jax.__version__.split(".")
  requires = importlib.metadata.metadata("jax")["Requires-Python"]
  if int(installed[1]) >= 11:
    assert requires.replace(" ", "") == ">=3.12", requires
  elif sys.version_info[:2] == (3, 11):
    assert installed[:2] == ["0", str(lo)]
  # the getting-started page names the same legs and probes
  guide = open(os.path.join(ROOT, "docs", "getting-started.md"),
               encoding="utf-8").read()
  for release in probes:
    assert release in guide, release



def test_the_test_count_table_has_a_row_per_install():
  """Issue 58: the table of what a passing run prints has a row for what
  the README's test command installs on each Python (3.11: jax 0.10.2;
  3.12 and 3.13: the newest 0.12), at a named commit."""
  guide = open(os.path.join(ROOT, "docs", "getting-started.md"),
               encoding="utf-8").read()
  section = guide.split("**What a passing test run looks like.**")[1]
  section = section.split("\n\n")[1]
  rows = [l for l in section.splitlines() if l.startswith("| 3.")]
  pythons = {".".join(l.split(",")[0].strip("| ").split(".")[:2]) for l in rows}
  assert {"3.11", "3.12"} <= pythons, rows
  for row in rows:
    assert re.search(r"`(\d+ failed, )?\d+ passed, \d+ skipped", row), row
  assert re.search(r"at commit [0-9a-f]{7}", guide.split(
      "**What a passing test run looks like.**")[1].split("\n\n")[0])
