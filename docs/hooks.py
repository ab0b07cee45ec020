"""MkDocs hooks: pages made from files that live outside ``docs/``.

The design documents stay in ``design/`` (the project's layout) and the
changelog at the root; this hook adds each of them to the site as a generated
page (``PAGES``), so nothing is copied by hand and nothing drifts. Relative
links in those files are rewritten for the page's new place: a link to
another included file goes to its page; a link to anything else in the
repository (a source file, a folder) becomes a link into the repository
browser when the project has a public address, and otherwise is rendered as
code (the path, which exists in the source tree).

The public address is one setting, ``Source`` in ``pyproject.toml``'s
``[project.urls]`` (a GitHub-style repository address, which a release fills
in; until then it is absent). With it, the site also shows the repository in
its header (``repo_url``) and every code span naming a repository file or
folder (`` `benchmarks/cost.py` ``, `` `python benchmarks/cost.py` ``) links
to that file (``link_code_paths``). Without it, nothing changes: the docs name
paths in the clone the reader has.

``PAGES`` and ``rewrite_links`` are plain Python (no MkDocs import at module
level), so ``tests/test_docs.py`` uses the same list of pages and the same
rewriting as the site.
"""

from __future__ import annotations

import os
import posixpath
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# repository file -> page of the site (relative to docs/)
PAGES = {
    "design/architecture.md": "design/architecture.md",
    "design/transformations.md": "design/transformations.md",
    "design/limitations.md": "design/limitations.md",
    "design/migration.md": "design/migration.md",
    "design/upstream.md": "design/upstream.md",
    "design/conformance.md": "design/conformance.md",
    "design/upstream/README.md": "design/upstream-patches.md",
    "CHANGELOG.md": "changelog.md",
}

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]+)\)")
_CODE_SPAN = re.compile(r"(`+).+?\1")


def source_address(root: str = ROOT) -> str | None:
  """The repository's public address: ``Source`` in ``pyproject.toml``'s
  ``[project.urls]``, or ``None`` while it has none."""
  with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
    urls = tomllib.load(fh)["project"].get("urls", {})
  return urls.get("Source") or None


def browse_url(address: str, path: str) -> str:
  """The page of repository file or folder ``path`` at ``address`` (the
  default branch; GitHub shows a folder at a ``blob`` address too)."""
  return f"{address.rstrip('/')}/blob/HEAD/{path}"


def _resolve(source: str, target: str) -> tuple[str, str]:
  """``(repository path, anchor)`` of a relative link in file ``source``."""
  path, _, anchor = target.partition("#")
  joined = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
  return joined, anchor


def _page_for(path: str) -> str | None:
  if path in PAGES:
    return PAGES[path]
  if os.path.isdir(os.path.join(ROOT, path)):
    readme = posixpath.join(path, "README.md")
    return PAGES.get(readme)
  return None


def rewrite_links(source: str, text: str, address: str | None = None) -> str:
  """``text`` (the markdown of repository file ``source``) with its relative
  links made right for ``source``'s page (see the module docstring); a link to
  a repository file without a page goes to ``address`` (``source_address()``)
  or, without one, becomes code. Fenced code blocks and code spans are left
  alone."""
  page = PAGES[source]
  out, in_fence = [], None
  for line in text.splitlines(keepends=True):
    fence = _FENCE.match(line.lstrip())
    if in_fence:
      if fence and fence.group(1) == in_fence:
        in_fence = None
      out.append(line)
      continue
    if fence:
      in_fence = fence.group(1)
      out.append(line)
      continue
    out.append(_rewrite_line(source, page, line, address))
  return "".join(out)


def _rewrite_line(source, page, line, address):
  spans = [m.span() for m in _CODE_SPAN.finditer(line)]

  def in_code(pos):
    return any(a <= pos < b for a, b in spans)

  def replace(m):
    if in_code(m.start()):
      return m.group(0)
    text, target = m.group("text"), m.group("target")
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
      return m.group(0)    # a URL, or an anchor on the same page
    path, anchor = _resolve(source, target)
    if path.startswith("../") or path == "..":
      raise ValueError(f"{source}: link {target!r} leaves the repository")
    if not os.path.exists(os.path.join(ROOT, path)):
      raise ValueError(f"{source}: link {target!r} names {path}, which does "
                       "not exist")
    to_page = _page_for(path)
    if to_page is not None:
      rel = posixpath.relpath(to_page, posixpath.dirname(page))
      return f"[{text}]({rel}{'#' + anchor if anchor else ''})"
    if address:
      return f"[{text}]({browse_url(address, path)})"
    shown = text if text.startswith("`") else f"{text} (`{path}`)"
    return shown
  return _LINK.sub(replace, line)


# the text of a code span that is a repository path, or a command running one
_PATH_CODE = re.compile(
    r"(?:python3? )?(?P<path>[A-Za-z0-9_-][A-Za-z0-9_.-]*(?:/[A-Za-z0-9_.-]+)*/?)"
    r"(?: [^`]*)?")


def link_code_paths(text: str, address: str | None, root: str = ROOT) -> str:
  """``text`` (a page's markdown) with each code span that names a file or
  folder of the repository -- `` `tests/test_contract.py` ``, `` `python
  benchmarks/cost.py --markdown` `` -- made a link to it at ``address``.
  A span must name a path with a ``/`` or a ``.`` in it that exists from the
  repository's root; spans inside a link, headings, fenced blocks and
  everything else are left alone. Without ``address``, ``text`` unchanged."""
  if not address:
    return text
  out, in_fence = [], None
  for line in text.splitlines(keepends=True):
    fence = _FENCE.match(line.lstrip())
    if in_fence or fence or line.lstrip().startswith("#"):
      if in_fence and fence and fence.group(1) == in_fence:
        in_fence = None
      elif fence and not in_fence:
        in_fence = fence.group(1)
      out.append(line)
      continue
    links = [m.span() for m in _LINK.finditer(line)]

    def link(m):
      code = m.group(0)[1:-1]
      found = _PATH_CODE.fullmatch(code)
      if m.group(1) != "`" or found is None \
          or any(a <= m.start() < b for a, b in links):
        return m.group(0)
      raw = found.group("path")
      path = raw.rstrip("/")
      if ("/" not in raw and "." not in raw) \
          or not os.path.exists(os.path.join(root, path)):
        return m.group(0)
      return f"[{m.group(0)}]({browse_url(address, path)})"
    out.append(_CODE_SPAN.sub(link, line))
  return "".join(out)


def page_source(page: str) -> str | None:
  """The repository file a generated page is made from, or ``None``."""
  for source, dest in PAGES.items():
    if dest == page:
      return source
  return None


# -- MkDocs event hooks ------------------------------------------------------------

def on_config(config):
  address = source_address()
  if address:
    config["repo_url"] = address    # the header's link to the repository
  return config


def on_files(files, config):
  from mkdocs.structure.files import File   # only when MkDocs runs

  address = source_address()
  for source, dest in PAGES.items():
    with open(os.path.join(ROOT, source), encoding="utf-8") as fh:
      text = rewrite_links(source, fh.read(), address)
    existing = files.get_file_from_path(dest)
    if existing is not None:
      files.remove(existing)
    files.append(File.generated(config, dest, content=text))
  return files


def on_page_markdown(markdown, page, config, files):
  return link_code_paths(markdown, source_address())
