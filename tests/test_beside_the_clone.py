"""A script in the folder that holds a clone named ``smartvjp`` (what
``git clone`` makes): what getting-started's "If import smartvjp finds an
empty package" says happens is what happens, and its remedies work."""

import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))

SCRIPT = "from smartvjp import smart_custom_vjp\nprint(smart_custom_vjp.__module__)\n"


def run(*argv, cwd):
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return subprocess.run([sys.executable, *argv], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def test_script_beside_a_folder_named_smartvjp(tmp_path):
  (tmp_path / "smartvjp").mkdir()       # a clone's root has no __init__.py
  (tmp_path / "beside.py").write_text(SCRIPT)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  (elsewhere / "script.py").write_text(SCRIPT)

  # where smartvjp is importable at all (its folder is not this checkout's
  # only copy on the path), the remedies import the real package
  for argv, cwd in ((["-P", "beside.py"], tmp_path),
                    (["script.py"], elsewhere)):
    done = run(*argv, cwd=cwd)
    if "No module named 'smartvjp'" in done.stderr:
      continue    # not installed: tests run from the source tree only
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "smartvjp._api", done.stdout

  done = run("beside.py", cwd=tmp_path)
  if done.returncode == 0:
    # an install Python finds before the script's folder's namesake (a
    # regular, non-editable one; or PYTHONPATH-style editable): no shadowing
    assert done.stdout.strip() == "smartvjp._api"
    return
  # an editable install found last: the docs quote the error exactly
  error = done.stderr.strip().splitlines()[-1]
  assert error == ("ImportError: cannot import name 'smart_custom_vjp' from "
                   "'smartvjp' (unknown location)"), done.stderr
  page = open(os.path.join(ROOT, "docs", "getting-started.md"),
              encoding="utf-8").read()
  assert f"`{error}`" in page
  assert re.search(r"`python -P script\.py`", page)
