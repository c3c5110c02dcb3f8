#!/usr/bin/env bash
# Builds the default base image of corolla's Dockerfile without Docker Hub: a minimal Debian root file system made by
# `debootstrap` from this machine's Debian mirror, with Python 3, venv and tini (PID 1: reaps orphans, forwards signals), imported with `docker import`.
# Usage: docker/make-base-image.sh [TAG]   (default corolla-base:bookworm; needs root, debootstrap and a daemon).
# Environment: SUITE (bookworm: its python3 is 3.11, the ABI of the wheels built by docker/build-wheels.sh),
# MIRROR (default: the first Debian mirror in /etc/apt/sources*, else http://deb.debian.org/debian), FORCE=1 rebuilds
# a tag that exists already.
set -euo pipefail
tag="${1:-corolla-base:bookworm}"
suite="${SUITE:-bookworm}"

if [ "${FORCE:-0}" != "1" ] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "make-base-image: $tag exists already (FORCE=1 rebuilds it)"; exit 0
fi
if [ "$(id -u)" != "0" ]; then echo "make-base-image: debootstrap needs root" >&2; exit 1; fi
if ! command -v debootstrap >/dev/null 2>&1; then
  echo "make-base-image: debootstrap is not installed (Debian: apt-get install debootstrap)" >&2; exit 1
fi

mirror="${MIRROR:-}"
if [ -z "$mirror" ]; then
  # The machine's own Debian mirror (deb822 `URIs:` or one-line `deb URL suite`), so nothing else is contacted.
  mirror="$(grep -rhoE '^(URIs:[[:space:]]*|deb[[:space:]]+)[^[:space:]]+/debian/?([[:space:]]|$)' \
    /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | awk '{print $2}' | head -n 1 || true)"
  mirror="${mirror:-http://deb.debian.org/debian}"
fi

rootfs="$(mktemp -d /tmp/corolla-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
echo "make-base-image: debootstrap $suite from $mirror into $rootfs"
start_s=$(date +%s)
nice -n 10 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,tini \
  "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || { tail -n 30 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"
# Nothing the image needs at run time: package caches, package lists, logs.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*.log \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
tar --numeric-owner -C "$rootfs" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
echo "make-base-image: $tag built in $(( $(date +%s) - start_s )) s ($(docker image inspect -f '{{.Size}}' "$tag") bytes)"
