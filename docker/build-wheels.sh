#!/usr/bin/env bash
# Fills the Docker build context with wheels built on this host, so that `docker build --network none` installs
# corolla without touching any network: docker/wheels/deps (every dependency, torch included; rebuilt only when
# corolla's requirements or the settings below change) and docker/wheels/corolla (corolla itself, rebuilt on every call).
# Usage: docker/build-wheels.sh
# Environment:
#   PYTHON           interpreter whose pip builds the wheels (default .venv/bin/python, else python3)
#   TORCH_SPEC       the torch requirement (default torch==2.13.0+cpu, the CPU wheel on this machine's index)
#   TORCH_INDEX_URL  an extra index for torch, e.g. https://download.pytorch.org/whl/cu126 for a CUDA build
#   EXTRAS           corolla extras to include, e.g. bench
#   PYTHON_VERSION   the image's Python (default 3.11, Debian 12's); PYTHON must be that version, as compiled
#                    wheels only fit their own Python (for a CUDA base with Python 3.12, pass a 3.12 PYTHON)
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

target_version="${PYTHON_VERSION:-3.11}"
host_version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$host_version" != "$target_version" ]; then
  echo "build-wheels: $python is Python $host_version but the image runs $target_version: pass PYTHON=<a Python $target_version>" >&2
  exit 2
fi
# The dependency wheels are keyed on what decides them: corolla's requirements (not the rest of pyproject.toml).
requirements="$("$python" -c 'import json, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(json.dumps([p["dependencies"], p.get("optional-dependencies", {})], sort_keys=True))')"
key="$(printf '%s' "$requirements" | sha256sum | cut -c1-16)|$torch_spec|${TORCH_INDEX_URL:-}|$extras|$target_version"
start_s=$(date +%s)
if [ -f "$out/deps/.key" ] && [ "$(cat "$out/deps/.key")" = "$key" ]; then
  echo "build-wheels: dependency wheels are up to date ($out/deps)"
else
  # Built aside and swapped in only when complete: a failed refresh (no index reachable) keeps the old wheels.
  staging="$out/deps.new"
  rm -rf "$staging" && mkdir -p "$staging"
  nice -n 10 "$python" -m pip wheel -q --wheel-dir "$staging" "${index_args[@]}" "$target" "$torch_spec"
  rm -f "$staging"/corolla-*.whl
  echo "$key" >"$staging/.key"
  rm -rf "$out/deps" && mv "$staging" "$out/deps"
fi
rm -rf "$out/corolla" && mkdir -p "$out/corolla"
nice -n 10 "$python" -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$out/corolla" . 2>/dev/null \
  || nice -n 10 "$python" -m pip wheel -q --no-deps --wheel-dir "$out/corolla" .
echo "build-wheels: $(ls "$out"/deps/*.whl | wc -l) dependency wheels + $(ls "$out"/corolla/*.whl) in $(( $(date +%s) - start_s )) s ($(du -sh "$out" | cut -f1))"
