#!/usr/bin/env bash
# A release that installs: build the sdist and the wheel (the wheel from the
# sdist, as `python -m build` does, so a file missing from the sdist fails
# here), check both with twine, install the wheel (not the source tree) into
# a fresh virtualenv with its runtime dependencies only, and run the seed
# demo from a copy outside the repository, so that it imports the installed
# package. Then build the documentation site strictly in a virtualenv with
# the `docs` extra.
#
# Usage: tools/release_check.sh [PYTHON]   (default: python3; CI passes the
# Python 3.13 interpreter; it must be a git checkout). Everything happens in
# a temporary folder, removed at exit; nothing is written to the repository.
# Set KEEP=1 to keep the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
py=${1:-python3}
work=$(mktemp -d)
if [ -z "${KEEP:-}" ]; then trap 'rm -rf "$work"' EXIT; else echo "keeping $work"; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 NO_MKDOCS_2_WARNING=1
start=$SECONDS
step() { echo "=== [$((SECONDS - start)) s] $*"; }
quiet_pip() {  # $1: pip; the rest: its arguments. Its log is shown on failure.
  local pip=$1; shift
  "$pip" install -q "$@" > "$work/pip.log" 2>&1 \
    || { cat "$work/pip.log"; echo "FAILED: pip install $*" >&2; exit 1; }
}

version=$("$py" - <<'EOF'
import ast
tree = ast.parse(open("smartvjp/__init__.py", encoding="utf-8").read())
print(next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
           and [getattr(t, "id", None) for t in n.targets] == ["__version__"]))
EOF
)
step "smartvjp $version, $("$py" --version): two fresh virtualenvs, one for the tools (build, twine, the docs extra), one with only the wheel's runtime dependencies (installed alongside, to save time)"
"$py" - "$work" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
open(f"{sys.argv[1]}/tools.txt", "w").write("\n".join(extras["release"] + extras["docs"]) + "\n")
open(f"{sys.argv[1]}/runtime.txt", "w").write("\n".join(project["dependencies"]) + "\n")
EOF
"$py" -m venv "$work/tools"
"$py" -m venv "$work/run"
( "$work/run/bin/pip" install -q -r "$work/runtime.txt" > "$work/runtime.log" 2>&1 \
  && echo ok > "$work/runtime.ok" ) &
runtime_job=$!
quiet_pip "$work/tools/bin/pip" -r "$work/tools.txt"

step "python -m build (sdist, then the wheel from the sdist), from a copy of the files git tracks or would track"
# (a copy: setuptools writes smartvjp.egg-info next to the sources, and a
# stray local file must not reach the sdist)
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - | tar -xf - -C "$work/src"
"$work/tools/bin/python" -m build --outdir "$work/dist" "$work/src" > "$work/build.log" 2>&1 \
  || { cat "$work/build.log"; echo "FAILED: python -m build" >&2; exit 1; }
# (setuptools says so when PYTHONDONTWRITEBYTECODE is set: not a problem)
if grep -i "warning" "$work/build.log" | grep -v "byte-compiling is disabled"; then
  echo "FAILED: python -m build printed warnings (above)" >&2; exit 1
fi
sdist="$work/dist/smartvjp-$version.tar.gz"
wheel="$work/dist/smartvjp-$version-py3-none-any.whl"
for f in "$sdist" "$wheel"; do
  [ -f "$f" ] || { ls "$work/dist"; echo "FAILED: $f was not built" >&2; exit 1; }
done

step "twine check --strict"
"$work/tools/bin/twine" check --strict "$sdist" "$wheel"

step "the wheel holds the package and its metadata, the sdist also README, CHANGELOG and the build files"
"$work/tools/bin/python" - "$wheel" "$version" "$sdist" <<'EOF'
import sys, tarfile, zipfile
wheel, version, sdist = sys.argv[1:]
members = {n.split("/", 2)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
want = {"smartvjp", "smartvjp.egg-info", "PKG-INFO", "README.md", "CHANGELOG.md",
        "pyproject.toml", "setup.cfg", "MANIFEST.in"}
assert members == want, sorted(members ^ want)
names = zipfile.ZipFile(wheel).namelist()
top = sorted({n.split("/")[0] for n in names})
assert top == ["smartvjp", f"smartvjp-{version}.dist-info"], top
meta = zipfile.ZipFile(wheel).read(f"smartvjp-{version}.dist-info/METADATA").decode()
for line in (f"Version: {version}", "License-Expression: Apache-2.0",
             "Requires-Python: >=3.11", "Description-Content-Type: text/markdown",
             "Classifier: Programming Language :: Python :: 3.13"):
  assert line in meta.splitlines(), line
print(f"{len(names)} files; metadata: version, license, Python, readme type ok")
EOF

step "install the wheel into the virtualenv holding only its runtime dependencies"
wait "$runtime_job" || true
[ -f "$work/runtime.ok" ] || { cat "$work/runtime.log"; echo "FAILED: installing the runtime dependencies" >&2; exit 1; }
quiet_pip "$work/run/bin/pip" "$wheel"
"$work/run/bin/pip" check
"$work/run/bin/python" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"

step "run the seed demo from a copy outside the repository"
mkdir "$work/demo"
cp examples/seed_remat.py "$work/demo/"
(cd "$work/demo" && env -u PYTHONPATH "$work/run/bin/python" - "$work/run" "$version" <<'EOF'
import os, sys
import smartvjp
venv, version = sys.argv[1:]
where = os.path.realpath(smartvjp.__file__)
assert where.startswith(os.path.realpath(venv) + os.sep), where
assert smartvjp.__version__ == version, smartvjp.__version__
print(f"smartvjp {smartvjp.__version__} from {where}")
EOF
)
(cd "$work/demo" && env -u PYTHONPATH "$work/run/bin/python" seed_remat.py)

step "mkdocs build --strict"
"$work/tools/bin/mkdocs" build --strict --site-dir "$work/site" 2>&1 \
  | { grep -v '^INFO' || true; }
[ -f "$work/site/index.html" ] || { echo "FAILED: mkdocs build" >&2; exit 1; }

step "release check passed: smartvjp $version"
