"""What a newcomer reads first runs as written: the README's usage snippet,
the runnable examples in the public docstrings, and ``help()`` pages without
inherited boilerplate."""

import os
import pydoc
import re
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
  # what it prints is the claim of its closing comments: f forward, f_fwd_bwd
  # inside the rematerialized region, f_fwd nowhere
  printed = capsys.readouterr().out.splitlines()
  assert len(printed) == 2, printed
  assert "smartvjp_primal[f=f " in printed[0]
  assert "smartvjp_bwd[f=f fwd_bwd=f_fwd_bwd]" in printed[1]
  program = ns["program"]
  region = program[program.index("remat2["):]
  assert "smartvjp_bwd" in region and "smartvjp_primal" not in region
  assert "smartvjp_fwd" not in program
  claimed = usage_snippet().split("# the schedule")[1]
  assert "forward pass: f" in claimed and "backward: f_fwd_bwd" in claimed


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
