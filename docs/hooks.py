"""MkDocs hooks: pages made from files that live outside ``docs/``.

The design documents stay in ``design/`` (the project's layout) and the
changelog at the root; this hook adds each of them to the site as a generated
page (``PAGES``), so nothing is copied by hand and nothing drifts. Relative
links in those files are rewritten for the page's new place: a link to
another included file goes to its page; a link to anything else in the
repository (a source file, a folder) becomes a link into the repository
browser when ``extra.source_url`` is set in ``mkdocs.yml``, and otherwise
is rendered as code (the path, which exists in the source tree).

``PAGES`` and ``rewrite_links`` are plain Python (no MkDocs import at module
level), so ``tests/test_docs.py`` uses the same list of pages and the same
rewriting as the site.
"""

from __future__ import annotations

import os
import posixpath
import re

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


def rewrite_links(source: str, text: str, source_url: str | None = None) -> str:
  """``text`` (the markdown of repository file ``source``) with its relative
  links made right for ``source``'s page (see the module docstring).
  Fenced code blocks and code spans are left alone."""
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
    out.append(_rewrite_line(source, page, line, source_url))
  return "".join(out)


def _rewrite_line(source, page, line, source_url):
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
    if source_url:
      return f"[{text}]({source_url.rstrip('/')}/{path})"
    shown = text if text.startswith("`") else f"{text} (`{path}`)"
    return shown
  return _LINK.sub(replace, line)


def page_source(page: str) -> str | None:
  """The repository file a generated page is made from, or ``None``."""
  for source, dest in PAGES.items():
    if dest == page:
      return source
  return None


# -- MkDocs event hooks ------------------------------------------------------------

def on_files(files, config):
  from mkdocs.structure.files import File   # only when MkDocs runs

  source_url = (config.get("extra") or {}).get("source_url")
  for source, dest in PAGES.items():
    with open(os.path.join(ROOT, source), encoding="utf-8") as fh:
      text = rewrite_links(source, fh.read(), source_url)
    existing = files.get_file_from_path(dest)
    if existing is not None:
      files.remove(existing)
    files.append(File.generated(config, dest, content=text))
  return files
