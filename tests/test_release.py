"""What a release carries: one version (``smartvjp.__version__``, read by the
build from the source and found in the installed metadata), a changelog
section for it, and complete package metadata. ``tools/release_check.sh``
builds the sdist and wheel and installs the wheel; this file checks what
can be checked without building."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import tomllib

import pytest

import smartvjp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))

# PEP 440, the forms this project uses: N.N.N with an optional pre-release,
# post-release or .devN suffix
VERSION = re.compile(r"(?P<release>\d+\.\d+\.\d+)"
                     r"(?P<suffix>(?:a|b|rc)\d+)?(?:\.post\d+)?(?P<dev>\.dev\d+)?")


def pyproject():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
    return tomllib.load(fh)


def source_version():
  """``__version__`` as setuptools reads it: a literal in the module's AST."""
  tree = ast.parse(open(os.path.join(ROOT, "smartvjp", "__init__.py"),
                        encoding="utf-8").read())
  found = [node.value.value for node in tree.body
           if isinstance(node, ast.Assign)
           and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
           and isinstance(node.value, ast.Constant)]
  assert len(found) == 1, "one literal __version__ = '...' at module level"
  return found[0]


def test_version_is_written_once_and_read_by_the_build():
  config = pyproject()
  assert "version" not in config["project"]
  assert "version" in config["project"]["dynamic"]
  attr = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
  assert attr == "smartvjp.__version__"
  assert source_version() == smartvjp.__version__
  assert VERSION.fullmatch(smartvjp.__version__), smartvjp.__version__


def test_installed_metadata_has_this_version():
  """Where the installed distribution is this source tree (``pip install -e
  .`` or a wheel built from it), its metadata carries ``__version__``."""
  try:
    dist = importlib.metadata.distribution("smartvjp")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("smartvjp is not installed (imported from the source tree)")
  direct = dist.read_text("direct_url.json")
  here = os.path.dirname(os.path.dirname(smartvjp.__file__))
  if direct:
    url = json.loads(direct).get("url", "")
    if url.startswith("file://") and os.path.realpath(url[7:]) != \
        os.path.realpath(here):
      pytest.skip(f"the installed smartvjp is another tree's ({url}); this "
                  f"test run imports {here}")
  assert dist.version == smartvjp.__version__


def changelog_sections():
  text = open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8").read()
  return re.findall(r"^## (\S+)(.*)$", text, re.M)


def test_changelog_has_the_current_version_first():
  m = VERSION.fullmatch(smartvjp.__version__)
  sections = changelog_sections()
  assert sections, "CHANGELOG.md has a '## <version> ...' section per release"
  heading, rest = sections[0]
  assert heading == m.group("release"), (
      f"the newest CHANGELOG.md section is {heading}, __version__ is "
      f"{smartvjp.__version__}")
  if m.group("dev") or m.group("suffix"):
    assert "unreleased" in rest, "a development version's section says so"
  else:
    assert re.search(r"\d{4}-\d{2}-\d{2}", rest), (
        "a released version's section has its date (YYYY-MM-DD)")
  versions = [tuple(int(p) for p in h.split(".")) for h, _ in sections]
  assert versions == sorted(versions, reverse=True), "newest first"


def test_package_metadata_is_complete():
  project = pyproject()["project"]
  assert project["license"] == "Apache-2.0"   # an SPDX expression (PEP 639)
  classifiers = project["classifiers"]
  assert not [c for c in classifiers if c.startswith("License ::")], (
      "PEP 639: the license expression replaces License classifiers")
  assert project["requires-python"] == ">=3.11"
  pythons = sorted(c.rsplit(" ", 1)[1] for c in classifiers
                   if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
  assert pythons == ["3.11", "3.12", "3.13"]   # as CI tests them (.ci/run)
  assert project["readme"] == {"file": "README.md",
                               "content-type": "text/markdown"}
  assert project["description"] and project["keywords"]
  assert any(c.startswith("Development Status ::") for c in classifiers)
  assert project["urls"]
  for url in project["urls"].values():
    assert url.startswith("https://"), url
  extras = project["optional-dependencies"]
  assert {"test", "examples", "docs", "release"} <= set(extras)
  assert any(r.startswith("mkdocs-material") for r in extras["docs"])
  assert any(r.startswith("mkdocstrings[python]") for r in extras["docs"])


def test_release_check_script_is_executable():
  path = os.path.join(ROOT, "tools", "release_check.sh")
  assert os.access(path, os.X_OK)
  text = open(path, encoding="utf-8").read()
  for step in ("python -m build", "twine check", "examples/seed_remat.py",
               "mkdocs build --strict"):
    assert step in text, step
