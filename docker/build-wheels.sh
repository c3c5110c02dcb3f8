#!/usr/bin/env bash
# Fills the Docker build context with wheels built on this host, so that `docker build --network none` installs
# corolla without touching any network: docker/wheels/deps (every dependency, torch included; rebuilt only when
# pyproject.toml or the settings below change) and docker/wheels/corolla (corolla itself, rebuilt on every call).
# Usage: docker/build-wheels.sh
# Environment:
#   PYTHON           interpreter whose pip builds the wheels (default .venv/bin/python, else python3); its Python
#                    version must be the image's (bookworm: 3.11) unless PYTHON_VERSION is set
#   TORCH_SPEC       the torch requirement (default torch==2.13.0+cpu, the CPU wheel on this machine's index)
#   TORCH_INDEX_URL  an extra index for torch, e.g. https://download.pytorch.org/whl/cu126 for a CUDA build
#   EXTRAS           corolla extras to include, e.g. bench
#   PYTHON_VERSION   e.g. 3.12: download binary wheels for that Python (pip download --python-version) instead of
#                    building with PYTHON's own version, for a base image with another Python (CUDA images); when
#                    unset and PYTHON is not 3.11 (the default base image's Python), 3.11 is downloaded for
set -euo pipefail
cd "$(dirname "$0")/.."
out=docker/wheels
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
torch_spec="${TORCH_SPEC:-torch==2.13.0+cpu}"
extras="${EXTRAS:-}"
target="."
[ -n "$extras" ] && target=".[$extras]"
index_args=()
[ -n "${TORCH_INDEX_URL:-}" ] && index_args+=(--extra-index-url "$TORCH_INDEX_URL")

if [ -z "${PYTHON_VERSION:-}" ] && [ "$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "3.11" ]; then
  PYTHON_VERSION=3.11
fi
# The dependency wheels are keyed on what decides them: corolla's requirements (not the rest of pyproject.toml).
requirements="$("$python" -c 'import json, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(json.dumps([p["dependencies"], p.get("optional-dependencies", {})], sort_keys=True))')"
key="$(printf '%s' "$requirements" | sha256sum | cut -c1-16)|$torch_spec|${TORCH_INDEX_URL:-}|$extras|${PYTHON_VERSION:-}|$("$python" -c 'import sys; print(sys.version_info[:2])')"
start_s=$(date +%s)
if [ -f "$out/deps/.key" ] && [ "$(cat "$out/deps/.key")" = "$key" ]; then
  echo "build-wheels: dependency wheels are up to date ($out/deps)"
else
  # Built aside and swapped in only when complete: a failed refresh (no index reachable) keeps the old wheels.
  staging="$out/deps.new"
  rm -rf "$staging" && mkdir -p "$staging"
  if [ -n "${PYTHON_VERSION:-}" ]; then
    # Binary wheels only, for the target Python; corolla's own requirements come from its metadata.
    mapfile -t reqs < <("$python" - "$extras" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = [r for r in project["dependencies"] if not r.replace(" ", "").startswith("torch")]
for extra in filter(None, sys.argv[1].split(",")):
    reqs += project["optional-dependencies"][extra]
print("\n".join(reqs))
PY
    )
    nice -n 10 "$python" -m pip download -q --only-binary=:all: --python-version "$PYTHON_VERSION" \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --implementation cp \
      --dest "$staging" "${index_args[@]}" "$torch_spec" "${reqs[@]}"
  else
    nice -n 10 "$python" -m pip wheel -q --wheel-dir "$staging" "${index_args[@]}" "$target" "$torch_spec"
    rm -f "$staging"/corolla-*.whl
  fi
  echo "$key" >"$staging/.key"
  rm -rf "$out/deps" && mv "$staging" "$out/deps"
fi
rm -rf "$out/corolla" && mkdir -p "$out/corolla"
nice -n 10 "$python" -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$out/corolla" . 2>/dev/null \
  || nice -n 10 "$python" -m pip wheel -q --no-deps --wheel-dir "$out/corolla" .
echo "build-wheels: $(ls "$out"/deps/*.whl | wc -l) dependency wheels + $(ls "$out"/corolla/*.whl) in $(( $(date +%s) - start_s )) s ($(du -sh "$out" | cut -f1))"
