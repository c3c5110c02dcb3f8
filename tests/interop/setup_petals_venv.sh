#!/usr/bin/env bash
# Creates the stock-Petals venv used by tests/interop (CPU torch, petals==2.2.0.post1 from PyPI).
# Workarounds (Petals itself is untouched): (1) hivemind 1.1.10.post2, pinned by petals, is sdist-only and its build
# downloads p2pd from GitHub: we build that sdist with p2pd taken from the hivemind 1.1.12 wheel (same daemon flags
# and control proto); (2) multiaddr pinned to 0.0.9 (newer ones break hivemind 1.1.10's unix socket paths);
# (3) a start-up shim re-exports two private torch names that torch 2.13 moved (hivemind 1.1.10 imports them).
set -euo pipefail
VENV="${1:-.venv-petals}"
PY="${PETALS_BASE_PYTHON:-python3.11}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" -q --disable-pip-version-check)
"${PIP[@]}" install torch==2.13.0 "setuptools<81" wheel grpcio-tools
"${PIP[@]}" download --no-deps --no-build-isolation hivemind==1.1.10.post2 -d "$WORK"
"${PIP[@]}" download --no-deps --only-binary :all: hivemind==1.1.12 -d "$WORK"
tar -xzf "$WORK"/hivemind-1.1.10.post2.tar.gz -C "$WORK"
SRC="$WORK/hivemind-1.1.10.post2"
"$VENV/bin/python" - "$WORK" "$SRC" <<'PY'
import glob, hashlib, os, re, sys, zipfile
work, src = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(work, "hivemind-1.1.12-*.whl"))[0]
dest = os.path.join(src, "hivemind", "hivemind_cli", "p2pd")
with zipfile.ZipFile(wheel) as zf, open(dest, "wb") as out:
    out.write(zf.read("hivemind/hivemind_cli/p2pd"))
os.chmod(dest, 0o755)
digest = hashlib.sha256(open(dest, "rb").read()).hexdigest()
setup_py = os.path.join(src, "setup.py")
text = open(setup_py).read()
text = re.sub(r'("p2pd-linux-amd64": )"[0-9a-f]+"', rf'\1"{digest}"', text)
open(setup_py, "w").write(text)
PY
"${PIP[@]}" install --no-build-isolation "$SRC" "multiaddr==0.0.9"  # newer multiaddr drops the leading / of unix paths
"${PIP[@]}" install petals==2.2.0.post1
# Second workaround: torch 2.13 moved two private names hivemind 1.1.10 imports; re-export them at start-up.
SP="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$(dirname "$0")/petals_torch_compat.py" "$SP/_corolla_petals_compat.py"
echo "import _corolla_petals_compat" > "$SP/_corolla_petals_compat.pth"
"$VENV/bin/python" -c "import petals, hivemind; print('petals', petals.__version__, 'hivemind', hivemind.__version__)"
echo "petals venv ready at $VENV in $(( $(date +%s) - start )) s"
