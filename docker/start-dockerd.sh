#!/usr/bin/env bash
# Starts a Docker daemon for corolla's image build and test when none answers yet (root only), and waits for it.
# Containers here run with `--network none`, so the daemon makes no bridge and touches no iptables rules.
# Usage: docker/start-dockerd.sh [LOG_FILE]   (default /tmp/corolla-dockerd.log); exit 0 when a daemon answers.
set -euo pipefail
log_file="${1:-/tmp/corolla-dockerd.log}"
wait_s="${DOCKERD_WAIT_S:-60}"

if ! command -v docker >/dev/null 2>&1; then
  echo "start-dockerd: no docker client installed" >&2; exit 1
fi
if docker info >/dev/null 2>&1; then
  echo "start-dockerd: a docker daemon already answers"; exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "start-dockerd: not root, cannot start dockerd" >&2; exit 1
fi
if ! command -v dockerd >/dev/null 2>&1; then
  echo "start-dockerd: dockerd is not installed (Debian: apt-get install docker.io)" >&2; exit 1
fi
# setsid: the daemon outlives this script and the CI step, in its own session (stopped with the machine).
setsid nice -n 10 dockerd --bridge=none --iptables=false --ip6tables=false >"$log_file" 2>&1 </dev/null &
for _ in $(seq 1 "$wait_s"); do
  if docker info >/dev/null 2>&1; then
    echo "start-dockerd: dockerd is up (log: $log_file)"; exit 0
  fi
  sleep 1
done
echo "start-dockerd: dockerd did not answer within ${wait_s} s; last lines of $log_file:" >&2
tail -n 20 "$log_file" >&2 || true
exit 1
