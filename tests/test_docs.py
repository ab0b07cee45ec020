"""The documentation site cannot drift from the code: every code block of its
pages (``docs/*.md`` and the files ``docs/hooks.py`` adds from ``design/``
and the root) runs or is checked here, and the site builds strictly.

* ``python`` blocks run, each page's in order, in one namespace per page. A
  block that cannot run here says why in a ``<!-- docs-test: skip: REASON -->``
  comment right above it; it is still compiled.
* ``bash`` blocks are checked: each command is one this file knows, and the
  files, script options and extras it names exist (``check_bash``); or the
  block is skipped with a reason, as above.
* ``text`` blocks are output: the paragraph above names the command that
  prints it (a script of the repository), or the block is generated and
  checked (``design/walkthrough.py --check``).
* ``mkdocs build --strict`` runs when MkDocs is installed (the ``docs``
  extra; CI runs it in ``tools/release_check.sh``), and every code block in
  the built pages is one of the blocks above.

The docstring examples that the API reference shows run in
``tests/test_docstrings.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib

import jax
import pytest

from smartvjp import _versions

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
DOCS = os.path.join(ROOT, "docs")


def _load_hooks():
  spec = importlib.util.spec_from_file_location(
      "smartvjp_docs_hooks", os.path.join(DOCS, "hooks.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


HOOKS = _load_hooks()


def site_pages() -> dict[str, str]:
  """``{page (relative to docs/): repository file it is made from}``."""
  pages = {os.path.relpath(p, DOCS): os.path.relpath(p, ROOT)
           for p in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)}
  for source, dest in HOOKS.PAGES.items():
    pages[dest] = source
  return dict(sorted(pages.items()))


PAGES = site_pages()


# -- blocks ------------------------------------------------------------------------

@dataclasses.dataclass
class Block:
  page: str
  line: int          # 1-based line of the opening fence in the source file
  lang: str
  code: str
  skip: str | None   # the reason given in a docs-test: skip comment
  before: str        # the prose between the previous block or heading and this one

  @property
  def id(self):
    return f"{self.page}:{self.line}"


_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^`]*)$")
_SKIP = re.compile(r"<!--\s*docs-test:\s*skip:\s*(?P<reason>.*?)\s*-->")


def blocks_of(page: str) -> list[Block]:
  text = open(os.path.join(ROOT, PAGES[page]), encoding="utf-8").read()
  lines = text.splitlines()
  out, i, prose_start = [], 0, 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if lines[i].startswith("#"):
      prose_start = i + 1
    if not m:
      i += 1
      continue
    fence, indent = m.group("fence"), len(m.group("indent"))
    lang = m.group("info").strip().split(" ")[0]
    j = i + 1
    while j < len(lines) and not lines[j].strip().startswith(fence):
      j += 1
    code = "\n".join(line[indent:] for line in lines[i + 1:j]) + "\n"
    prev = [line for line in lines[prose_start:i]]
    skip = None
    k = i - 1
    while k >= 0 and not lines[k].strip():
      k -= 1
    if k >= 0:
      found = _SKIP.search(lines[k])
      if found:
        skip = found.group("reason")
    out.append(Block(page, i + 1, lang, code, skip, "\n".join(prev)))
    i = j + 1
    prose_start = i
  return out


ALL_BLOCKS = [b for page in PAGES for b in blocks_of(page)]


def test_every_block_has_a_known_language():
  bad = [f"{b.id} ({b.lang or 'no language'})" for b in ALL_BLOCKS
         if b.lang not in ("python", "bash", "text")]
  assert not bad, ("give each fenced block a language: python (run), bash "
                   f"(checked) or text (output): {bad}")


def test_no_indented_code_blocks():
  """An indented code block would escape the checks below: use fences."""
  found = []
  for page, source in PAGES.items():
    in_fence, prev_blank, prev_text = False, True, ""
    for n, line in enumerate(open(os.path.join(ROOT, source),
                                  encoding="utf-8"), 1):
      if _FENCE.match(line.rstrip("\n")):
        in_fence = not in_fence
      elif (not in_fence and prev_blank and line.startswith("    ")
            and line.strip()
            and not re.match(r"\s*([-*+]|\d+\.)\s", prev_text)
            and not prev_text.startswith(" ")):
        found.append(f"{page}:{n}")
      if line.strip():
        prev_text = line
      prev_blank = not line.strip()
  assert not found, found


def test_skipped_blocks_give_a_reason_naming_files_that_exist():
  for b in ALL_BLOCKS:
    if b.skip is None:
      continue
    assert len(b.skip.split()) >= 5, f"{b.id}: say why the block is skipped"
    here = os.path.dirname(PAGES[b.page])
    for name in re.findall(r"[\w./-]+\.(?:py|patch|md)\b", b.skip):
      assert (os.path.exists(os.path.join(ROOT, name))
              or os.path.exists(os.path.join(ROOT, here, name))), (b.id, name)
    if b.lang == "python":
      compile(b.code, b.id, "exec")


# -- python ------------------------------------------------------------------------

PYTHON_PAGES = sorted({b.page for b in ALL_BLOCKS
                       if b.lang == "python" and b.skip is None})


# libraries of the ports and tesseract extras, not of the test extra: a block that imports
# one runs where it is installed (CI's newest combination), else is left out
_OPTIONAL = ("flax", "tesseract_core", "tesseract_jax")


def _needs_missing_library(code: str) -> bool:
  if "pallas.ops.gpu" in code and not _versions.SHIPS_TRITON_PALLAS_OPS:
    return True   # JAX's Triton Pallas kernels: jax 0.12.1 removed them
  return any(re.search(rf"^\s*(import|from) {name}\b", code, re.M)
             and importlib.util.find_spec(name) is None for name in _OPTIONAL)


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_run(page):
  namespace = {"__name__": "__docs__"}
  ran = 0
  for b in blocks_of(page):
    if (b.lang != "python" or b.skip is not None
        or _needs_missing_library(b.code)):
      continue
    exec(compile(b.code, b.id, "exec"), namespace)
    ran += 1
  assert ran


# -- bash --------------------------------------------------------------------------

def _extras():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
    project = tomllib.load(fh)["project"]
  return project["name"], set(project["optional-dependencies"])


def _check_script(path, args, here):
  """``python PATH ARGS``: the file exists and knows each ``--option``."""
  full = next((p for p in (os.path.join(ROOT, path), os.path.join(ROOT, here, path))
               if os.path.isfile(p)), None)
  assert full, f"no such file: {path}"
  source = open(full, encoding="utf-8").read()
  for a in args:
    if a.startswith("--"):
      option = a.split("=")[0]
      assert f'"{option}"' in source or f"'{option}'" in source, (
          f"{path} has no option {option}")


def check_bash(code: str, here: str) -> None:
  """Each command of a bash block is one we know and what it names exists.
  ``here``: the page's folder in the repository (for relative names)."""
  name, extras = _extras()
  commands = []
  for line in code.replace("\\\n", " ").splitlines():
    if not line.strip() or line.lstrip().startswith("#"):
      continue
    # $(...) substitutions are checked only for being well formed
    line = re.sub(r'"\$\((.*?)\)"', "SUBSTITUTION", line)
    for part in re.split(r"&&|\|\||;|\|", line):
      words = shlex.split(part)
      if words:
        commands.append(words)
  assert commands
  for words in commands:
    cmd, args = words[0], words[1:]
    if re.fullmatch(r"python(3(\.\d+)?)?", cmd):
      if args[:1] == ["-m"]:
        assert args[1] in ("pytest", "venv", "build", "twine", "mkdocs", "pip",
                           "http.server"), f"python -m {args[1]}"
      else:
        _check_script(args[0], args[1:], here)
    elif cmd == "pip":
      assert args[0] == "install", words
      for a in args[1:]:
        if a in ("-e", "-q", "--upgrade"):
          continue
        m = re.fullmatch(r"\.(?:\[(?P<extras>[\w,]+)\])?", a)
        if m:
          assert set((m.group("extras") or "").split(",")) - {""} <= extras, a
        else:
          assert a == name, f"pip install {a}: not this project"
    elif cmd == "test":
      assert args[:1] in (["-d"], ["-f"]), words
    elif cmd in (".", "source"):
      assert args == [".venv/bin/activate"], words
    elif cmd == "cd":
      assert args == ["SUBSTITUTION"] or os.path.isdir(
          os.path.join(ROOT, args[0])), words
    elif cmd == "patch":
      assert args[0] == "-p1" and args[1] == "<", words
      target = args[2].replace(".../", "")
      assert os.path.isfile(os.path.join(ROOT, here, target)), target
    elif cmd == "mkdocs":
      assert args[0] in ("serve", "build"), words
      assert os.path.isfile(os.path.join(ROOT, "mkdocs.yml"))
    else:
      raise AssertionError(f"unknown command {cmd!r}: teach check_bash about "
                           "it, or skip the block with a reason")


BASH_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "bash"]


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=lambda b: b.id)
def test_bash_blocks_are_checked(block):
  if block.skip is not None:
    pytest.skip(block.skip)
  check_bash(block.code, os.path.dirname(PAGES[block.page]))


def test_check_bash_catches_what_it_should():
  here = "design/upstream"
  check_bash('pip install -e ".[examples]" && python examples/seed_remat.py', "")
  for wrong in ('pip install -e ".[nonsense]"', "python examples/missing.py",
                "python design/upstream/check.py --no-such-option",
                "patch -p1 < .../missing.patch", "rm -rf /", "pip install numpy"):
    with pytest.raises(AssertionError):
      check_bash(wrong, here)


# -- text (output) -----------------------------------------------------------------

WALKTHROUGH = re.compile(
    r"<!-- walkthrough:begin -->.*?_Generated by `python design/walkthrough.py` "
    r"\(jax (?P<version>[^)]+)\)\._(?P<body>.*?)<!-- walkthrough:end -->", re.S)


def _in_walkthrough(block):
  text = open(os.path.join(ROOT, PAGES[block.page]), encoding="utf-8").read()
  m = WALKTHROUGH.search(text)
  if not m:
    return False
  start = text[:m.start()].count("\n") + 1
  end = text[:m.end()].count("\n") + 1
  return start < block.line < end


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang == "text"],
                         ids=lambda b: b.id)
def test_text_blocks_are_the_output_of_a_named_script(block):
  if _in_walkthrough(block):
    return   # generated and compared by test_walkthrough_is_current
  scripts = re.findall(r"`python3? ([\w/.-]+\.py)", block.before)
  assert scripts, (f"{block.id}: say which command prints this output in the "
                   "paragraph above it")
  for path in scripts:
    assert os.path.isfile(os.path.join(ROOT, path)), path


def test_walkthrough_is_current():
  text = open(os.path.join(ROOT, "design", "architecture.md"),
              encoding="utf-8").read()
  version = WALKTHROUGH.search(text).group("version")
  if version != jax.__version__:
    pytest.skip(f"the walkthrough was generated with jax {version}; its "
                f"jaxprs differ on jax {jax.__version__} (checked where they "
                "match)")
  run = subprocess.run([sys.executable, "design/walkthrough.py", "--check"],
                       cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           [ROOT, os.environ.get("PYTHONPATH", "")])})
  assert run.returncode == 0, run.stdout + run.stderr


# -- the site's structure ----------------------------------------------------------

def _nav_entries():
  text = open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8").read()
  nav = text.split("\nnav:\n")[1].split("\n\n")[0]
  return re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", nav, re.M)


def test_nav_lists_every_page_once():
  nav = _nav_entries()
  assert sorted(nav) == sorted(PAGES), (sorted(nav), sorted(PAGES))


def _url(page):
  """The page's folder in the built site (MkDocs' directory URLs)."""
  if page == "index.md" or page.endswith("/index.md"):
    return page[:-len("index.md")]
  return page[:-len(".md")] + "/"


def test_pages_have_distinct_urls():
  urls = [_url(p) for p in PAGES]
  assert len(set(urls)) == len(urls), sorted(urls)


def test_relative_links_resolve():
  for page, source in PAGES.items():
    text = open(os.path.join(ROOT, source), encoding="utf-8").read()
    if source in HOOKS.PAGES:
      text = HOOKS.rewrite_links(source, text)   # raises on a missing target
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        continue
      if target.lower().endswith((".png", ".svg", ".jpg")):   # a picture
        assert os.path.exists(os.path.join(ROOT, os.path.dirname(source),
                                           target)), f"{page}: {target}"
        continue
      path = os.path.normpath(os.path.join(os.path.dirname(page),
                                           target.split("#")[0]))
      assert path in PAGES, f"{page}: link to {target} (no page {path})"


def test_hooks_render_links_to_other_files_as_code():
  text = "See [`the tool`](../tools/jax_suite.py) and [plan](../smartvjp/_plan.py)."
  out = HOOKS.rewrite_links("design/architecture.md", text)
  assert out == "See `the tool` and plan (`smartvjp/_plan.py`)."
  linked = HOOKS.rewrite_links("design/architecture.md", text,
                               "https://example.org/smartvjp")
  assert "(https://example.org/smartvjp/blob/HEAD/tools/jax_suite.py)" in linked
  with pytest.raises(ValueError, match="does not exist"):
    HOOKS.rewrite_links("design/architecture.md", "[x](missing.md)")


def test_code_naming_a_repository_file_links_to_it_once_there_is_an_address():
  text = ("a test in `tests/test_contract.py`, by `python benchmarks/cost.py "
          "--markdown`, in `benchmarks/`; not `jax.custom_vjp`, `f 1, fwd 1`, "
          "`missing/file.py`, [`tools/jax_suite.py`](x), ``a `tests/` b``\n"
          "## `tests/test_contract.py`\n```bash\npython benchmarks/cost.py\n```\n")
  assert HOOKS.link_code_paths(text, None) == text
  out = HOOKS.link_code_paths(text, "https://example.org/smartvjp/")
  site = "https://example.org/smartvjp/blob/HEAD"
  assert out == text.replace(
      "`tests/test_contract.py`,", f"[`tests/test_contract.py`]({site}/tests/test_contract.py),", 1
  ).replace("`python benchmarks/cost.py --markdown`",
            f"[`python benchmarks/cost.py --markdown`]({site}/benchmarks/cost.py)"
  ).replace("`benchmarks/`;", f"[`benchmarks/`]({site}/benchmarks);")


def _user_facing_files():
  """The files a user reads or runs: pages, examples, benchmarks, tools,
  the package (its docstrings and messages), not the tests."""
  for folder in ("docs", "design", "examples", "benchmarks", "tools",
                 "smartvjp"):
    for path in glob.glob(os.path.join(ROOT, folder, "**", "*"),
                          recursive=True):
      if path.endswith((".md", ".py", ".sh", ".toml", ".txt")) and \
          os.path.isfile(path):
        yield path
  for name in ("README.md", "CHANGELOG.md", "pyproject.toml"):
    yield os.path.join(ROOT, name)


INSTALL = re.compile(r"pip install (?:-e )?[\"']?(?P<target>[^\s\"'`]+)")


def test_install_lines_have_the_readme_s_form():
  """Every ``pip install`` of this project that a page, example or message
  gives has the README's form, from the clone (``pip install -e
  ".[extra]"``), since smartvjp is not on PyPI (``pip install
  "smartvjp[extra]"`` cannot work); each extra it names exists; and where
  it installs the ``tesseract`` extra it says that needs Python 3.12 or
  newer (tesseract-jax 0.5's floor)."""
  name, extras = _extras()
  readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  assert 'pip install -e ".[examples]"' in readme and "not on PyPI" in \
      readme.replace("Not on PyPI", "not on PyPI")
  wrong = []
  for path in _user_facing_files():
    text = open(path, encoding="utf-8").read()
    for m in INSTALL.finditer(text):
      target, where = m.group("target"), (
          f"{os.path.relpath(path, ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
      if target.startswith(f"{name}["):
        wrong.append(f"{where}: {m.group(0)} (not on PyPI: use "
                     f"pip install -e \".[...]\" in the clone)")
      elif re.fullmatch(r"\.\[[\w,]+\]", target):
        missing = set(target[2:-1].split(",")) - extras
        if missing:
          wrong.append(f"{where}: no extra {sorted(missing)}")
        nearby = text[max(0, m.start() - 300):m.end() + 300]
        if "tesseract" in target and "3.12" not in nearby:
          wrong.append(f"{where}: the tesseract extra without 'Python 3.12'")
  assert not wrong, "\n".join(wrong)


def test_the_public_address_is_one_setting():
  """``Source`` in pyproject.toml's [project.urls] is the only place the
  repository's address is written (a release fills it in): the docs site
  reads it from there, and the README says how to get the source without
  it, or names it."""
  config = open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8").read()
  assert not re.search(r"^\s*(repo_url|edit_uri|source_url):", config, re.M)
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
    urls = tomllib.load(fh)["project"].get("urls", {})
  address = HOOKS.source_address()
  assert address == (urls.get("Source") or None)
  readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  install = readme.split("**Install.**")[1].split("\n")[0]
  if address is None:
    assert "not public yet" in install and "pip install /path/to/" in install
  else:
    assert address in install and "not public yet" not in install


def module_all(module: str) -> list[str]:
  """``smartvjp.<module>.__all__``, read from the source (``tesseract``
  imports tesseract_core, which the ``test`` extra does not install)."""
  path = os.path.join(ROOT, "smartvjp", f"{module}.py")
  tree = ast.parse(open(path, encoding="utf-8").read())
  for node in tree.body:
    if (isinstance(node, ast.Assign) and
        [getattr(t, "id", None) for t in node.targets] == ["__all__"]):
      return list(ast.literal_eval(node.value))
  raise AssertionError(f"{path} has no __all__")


def test_api_reference_covers_every_public_name():
  import smartvjp
  import smartvjp.testing
  text = open(os.path.join(DOCS, "api.md"), encoding="utf-8").read()
  shown = re.findall(r"^::: smartvjp\.(\w+)$", text, re.M)
  public = [n for n in smartvjp.__all__ if n != "__version__"]
  assert sorted(set(shown) - {"tesseract"}) == sorted(public)
  for name, members in re.findall(
      r"^::: smartvjp\.(\w+)\n    options:\n      members:\n((?:        - \w+\n)+)",
      text, re.M):
    for member in re.findall(r"- (\w+)", members):
      assert callable(getattr(getattr(smartvjp, name), member)), (name, member)
  # the public submodules: smartvjp.testing's names one by one, and
  # smartvjp.tesseract's as members of the module's entry
  assert re.findall(r"^::: smartvjp\.testing\.(\w+)$", text, re.M) == \
      smartvjp.testing.__all__
  entry = re.search(r"^::: smartvjp\.tesseract\n((?:    .*\n)+)", text, re.M)
  assert entry, "docs/api.md has no entry for smartvjp.tesseract"
  assert re.findall(r"^        - (\w+)$", entry.group(1), re.M) == \
      module_all("tesseract")


# -- mkdocs build --strict -----------------------------------------------------------

def test_mkdocs_build_strict(tmp_path):
  if importlib.util.find_spec("mkdocs") is None:
    pytest.skip("MkDocs is not installed in this environment (pip install -e "
                "'.[docs]'); CI builds the site in tools/release_check.sh")
  site = tmp_path / "site"
  run = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
      cwd=ROOT, capture_output=True, text=True,
      env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
  assert run.returncode == 0, run.stdout + run.stderr
  # every code block on the built pages is one that this file runs or checks
  # (or, on the API reference, a signature or a docstring example, which
  # tests/test_docstrings.py runs)
  for page in PAGES:
    html = (site / _url(page) / "index.html").read_text(encoding="utf-8")
    built = html.count("<pre")
    if page == "api.md":
      built -= html.count('<div class="doc-signature highlight"><pre')
      expected = _api_docstring_blocks()
    else:
      expected = len(blocks_of(page))
    assert built == expected, (page, built, expected)


def _api_docstring_blocks():
  """Fenced blocks in the docstrings the API reference shows."""
  import inspect
  import smartvjp
  text = open(os.path.join(DOCS, "api.md"), encoding="utf-8").read()
  import smartvjp.testing
  count = 0
  for name, rest in re.findall(r"^::: smartvjp\.([\w.]+)\n((?:    .*\n)*)",
                               text, re.M):
    members = re.findall(r"- (\w+)", rest)
    if name == "tesseract":   # read from the source: needs tesseract_core
      tree = ast.parse(open(os.path.join(ROOT, "smartvjp", "tesseract.py"),
                            encoding="utf-8").read())
      docs = [ast.get_docstring(n) for n in tree.body
              if getattr(n, "name", None) in members]
    else:
      obj = smartvjp
      for part in name.split("."):
        obj = getattr(obj, part)
      docs = [inspect.getdoc(obj)] + [
          inspect.getdoc(getattr(obj, m)) for m in members]
    count += sum(len(re.findall(r"^```", d or "", re.M)) // 2 for d in docs)
  return count


# -- files the pages name ------------------------------------------------------------

_REPO_PATH = re.compile(
    r"`((?:smartvjp|tests|benchmarks|examples|tools|design|docs|\.ci)/"
    r"[\w./-]*\w)(?::[\w]+)?`")
# paths in JAX's repository, named as such by the sentence around them
NOT_OURS = {"tests/custom_api_test.py", "tests/api_test.py", "tests/BUILD",
             "docs/new_docs/301/remat.md"}


def test_files_named_in_code_exist():
  """A repository path written as code on a page (``smartvjp/_plan.py``)
  names a file or folder that exists."""
  missing = []
  for page, source in PAGES.items():
    text = open(os.path.join(ROOT, source), encoding="utf-8").read()
    for path in _REPO_PATH.findall(text):
      if path in NOT_OURS:
        continue
      here = os.path.dirname(source)
      if not (os.path.exists(os.path.join(ROOT, path))
              or os.path.exists(os.path.join(ROOT, here, path))):
        missing.append(f"{page}: {path}")
  assert not missing, missing


def test_wide_blocks_scroll_and_table_code_does_not_break():
  """The site's stylesheet keeps wide content on the page: benchmark dumps
  (lines up to ~170 characters) scroll in their block, wide tables scroll,
  and code in a table cell stays on one line (no "optimize_rema t=True").
  How the pages look is checked in a browser by ``tools/docs_layout.py``
  (headless Chromium, by hand: CI has none)."""
  css = open(os.path.join(ROOT, "docs", "stylesheets", "extra.css")).read()
  rules = dict((sel.strip(), body) for sel, body in
               re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(r"/\*.*?\*/", "",
                                                         css, flags=re.S)))
  assert "overflow-x: auto" in rules[".md-typeset pre > code"]
  assert "overflow-x: auto" in rules[".md-typeset__table,\n.md-typeset__scrollwrap"]
  assert "white-space: nowrap" in rules[".md-typeset table:not([class]) code"]


def test_performance_cost_table_is_the_output_below_it():
  """The performance page's cost table (a markdown table, which the site
  fits to the page) holds the figures of the script output printed under
  it, row by row."""
  text = open(os.path.join(DOCS, "performance.md"), encoding="utf-8").read()
  section = text.split("## Work per policy")[1].split("\n## ")[0]
  table = [l for l in section.splitlines() if l.startswith("| ")][1:]
  output = next(b for b in blocks_of("performance.md") if b.lang == "text")
  rows, policy = [], None
  for line in output.code.splitlines():
    m = re.match(r"^(\S.*?\S)\s{2,}(saveable|mixed|kernel|named)\s+(.*)$", line)
    if m:
      cells = re.findall(r"(n/a|[\d.]+)/([\d.]+)/([\d.]+)/(\d+) \(([^)]*)\)",
                         m.group(3))
      rows.append((m.group(1), m.group(2),
                   [f"{a} / {b} / {c} / {d} ({e})" for a, b, c, d, e in cells]))
  shown = []
  for line in table:
    cells = [c.strip() for c in line.strip("|").split("|")]
    policy = cells[0].strip("`") or policy
    shown.append((policy, cells[1], cells[2:]))
  assert len(rows) == 48 and shown == rows
