"""Does every page of the docs site fit its window? Looked at in headless
Chromium, not guessed from the stylesheet.

Builds the site (``mkdocs build --strict``, the ``docs`` extra), serves it on
127.0.0.1, opens every page at each window width in headless Chromium with a
script added to the page, and reports, per page and width:

- the page or its content column scrolling sideways (something wider than the
  page that no block of its own scrolls: a benchmark dump, a wide table);
- code in a table cell or header broken over two lines (a name cut in the
  middle, "optimize_rema t=True").

Wide code blocks and tables that scroll inside their own block are fine; a
table's scroll area may reach 20 px into the column's padding (Material's
own margin). ``--screenshots DIR`` also saves a PNG of each page.

Usage: ``python tools/docs_layout.py [--widths 1280,1024,390]
[--chromium PATH] [--screenshots DIR]``; exit status 1 when a page does not
fit. Chromium: Debian's ``apt-get install chromium``. Nothing is written to
the repository (the site is built in a temporary folder).
"""

from __future__ import annotations

import argparse
import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Added before </body> of every page; writes its findings into
# <pre id="layout-report">, which --dump-dom returns.
CHECK = """<script>
window.addEventListener("load", () => {
  const main = document.querySelector(".md-content__inner");
  const slack = 20;
  const found = [];
  const doc = document.documentElement;
  if (doc.scrollWidth > window.innerWidth + 1)
    found.push(`the page scrolls sideways: ${doc.scrollWidth} px wide in a ${window.innerWidth} px window`);
  if (main.scrollWidth > main.clientWidth + slack)
    found.push(`the content column overflows: ${main.scrollWidth} px in ${main.clientWidth} px`);
  const right = main.getBoundingClientRect().right + slack;
  for (const el of main.querySelectorAll("*")) {
    const box = el.getBoundingClientRect();
    if (box.width === 0) continue;
    const style = getComputedStyle(el);
    let over = style.overflowX === "visible" && el.clientWidth > 0
        && el.scrollWidth > el.clientWidth + slack;
    if (!over && box.right > right) {
      over = true;   // unless a scrolling block inside the column clips it
      for (let a = el.parentElement; a && a !== main; a = a.parentElement) {
        if (getComputedStyle(a).overflowX !== "visible"
            && a.getBoundingClientRect().right <= right) { over = false; break; }
      }
    }
    if (over) found.push(`<${el.tagName.toLowerCase()} class="${el.className}"> ends at ${Math.round(box.right)} px, content ${el.scrollWidth} px: ${el.textContent.slice(0, 60).replace(/\\s+/g, " ")}`);
  }
  for (const code of main.querySelectorAll("table code")) {
    if (code.getClientRects().length > 1)
      found.push(`code broken over lines in a table: ${code.textContent}`);
  }
  const pre = document.createElement("pre");
  pre.id = "layout-report";
  pre.textContent = JSON.stringify(found);
  document.body.appendChild(pre);
});
</script>
"""

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def build_site(out: str) -> None:
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                         "--site-dir", out], cwd=ROOT, env=env,
                        capture_output=True, text=True)
  if done.returncode:
    sys.exit(f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}")


def pages(site: str) -> list[str]:
  """Every page's address relative to the site root ("" is the home page)."""
  found = []
  for folder, _, files in os.walk(site):
    if "index.html" in files:
      rel = os.path.relpath(folder, site)
      found.append("" if rel == "." else rel.replace(os.sep, "/") + "/")
  return sorted(p for p in found if not p.startswith(("assets/", "search/")))


def add_check(site: str, page: str) -> None:
  path = os.path.join(site, page, "index.html")
  with open(path, encoding="utf-8") as fh:
    text = fh.read()
  with open(path, "w", encoding="utf-8") as fh:
    fh.write(text.replace("</body>", CHECK + "</body>", 1))


def chromium(binary: str, url: str, width: int, *extra: str) -> str:
  with tempfile.TemporaryDirectory() as profile:
    done = subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
         f"--window-size={width},2000", "--virtual-time-budget=3000", *extra, url],
        capture_output=True, text=True, timeout=120)
  return done.stdout


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--widths", default="1280,1024,390",
                      help="window widths in px, comma-separated")
  parser.add_argument("--chromium", default=None,
                      help="the browser (default: chromium on PATH)")
  parser.add_argument("--screenshots", default=None,
                      help="folder for one PNG per page and width")
  args = parser.parse_args()
  binary = args.chromium or next(
      (b for b in ("chromium", "chromium-browser", "google-chrome")
       if shutil.which(b)), None)
  if binary is None:
    sys.exit("no Chromium found: apt-get install chromium, or pass --chromium")
  widths = [int(w) for w in args.widths.split(",")]
  with tempfile.TemporaryDirectory() as work:
    site = os.path.join(work, "site")
    build_site(site)
    shots = os.path.join(work, "shots")
    if args.screenshots:
      shutil.copytree(site, shots)   # the pages as built, without the check
    names = pages(site)
    for page in names:
      add_check(site, page)
    handler = functools.partial(_QuietHandler, directory=work)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    failed = 0
    try:
      for width in widths:
        for page in names:
          dom = chromium(binary, f"{base}/site/{page}", width, "--dump-dom")
          m = re.search(r'<pre id="layout-report">(.*?)</pre>', dom, re.S)
          problems = (["no report (the page did not load?)"] if m is None else
                      json.loads(html.unescape(m.group(1))))
          print(f"{width:5d} px  /{page}: {'ok' if not problems else 'DOES NOT FIT'}")
          for p in problems[:8]:
            print(f"           {p}")
          failed += bool(problems)
          if args.screenshots:
            os.makedirs(args.screenshots, exist_ok=True)
            png = os.path.abspath(os.path.join(
                args.screenshots, f"{(page.strip('/') or 'index').replace('/', '-')}-{width}.png"))
            chromium(binary, f"{base}/shots/{page}", width, f"--screenshot={png}")
    finally:
      server.shutdown()
  print(f"{failed} page views of {len(names) * len(widths)} do not fit"
        if failed else f"all {len(names)} pages fit at {args.widths} px")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
