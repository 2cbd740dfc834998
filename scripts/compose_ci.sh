#!/usr/bin/env bash
# The docker-compose cluster for real (CI): start a docker engine (../shared/docker), build the
# image, run the cluster on the host network, restart the `ps` shard mid-run and check that it
# restored its state and the workers rode through, take the verdict of the `check` job, and
# tear everything down. Timings are printed as `compose-ci: <phase> <seconds> s`.
#
#   bash scripts/compose_ci.sh            # from the repository root; needs root (dockerd)
#
# Environment: SHARED_DIR (default ../shared), RESTART_AT_CLOCK (default 25: the min clock of
# shard `ps` at which it is restarted), COMPOSE_LOG (default compose-ci.log).
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED_DIR=${SHARED_DIR:-../shared}
RESTART_AT_CLOCK=${RESTART_AT_CLOCK:-25}
COMPOSE_LOG=${COMPOSE_LOG:-compose-ci.log}
export PATH="/usr/bin:$PATH"            # the Debian docker client (with compose), not another
export PYTHON_BASE=local/python-base:bookworm
DOCKER=/usr/bin/docker
DC=(docker-compose -p paramserver-ci -f docker-compose.yml -f docker-compose.hostnet.yml)
PS_CLI=${PS_CLI:-.venv/bin/paramserver}
command -v "$PS_CLI" >/dev/null 2>&1 || PS_CLI=paramserver

t_start=$(date +%s)
phase() { echo "compose-ci: $1 $(( $(date +%s) - $2 )) s"; }

teardown() {
  local rc=$?
  "${DC[@]}" logs --no-color >"$COMPOSE_LOG" 2>&1 || true
  if [ "$rc" != 0 ]; then
    # Say why here: CI keeps only this output, not $COMPOSE_LOG. (A job's container exits 0;
    # its paramserver exit code is in the results volume, reported by the check job's line.)
    for svc in worker-0 worker-1 worker-2 worker-3 spmd-demo ps ps-1 check; do
      echo "compose-ci: ---- last lines of $svc ----"
      "${DC[@]}" logs --no-color --tail 30 "$svc" 2>&1 || true
    done
  fi
  "${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  bash "$SHARED_DIR/docker/stop-docker.sh" || true
  echo "compose-ci: total $(( $(date +%s) - t_start )) s (exit $rc; logs in $COMPOSE_LOG)"
}

t=$(date +%s)
bash "$SHARED_DIR/docker/start-docker.sh"
trap teardown EXIT
phase "docker-engine" "$t"

t=$(date +%s)
"${DC[@]}" build --quiet ps
phase "image-build" "$t"

# docker-compose up --build: every service (one cached image); -d so that the restart below can
# happen while the job runs. The verdict is the exit code of the `check` job (docker wait).
t_up=$(date +%s)
"${DC[@]}" up --build -d
check_id=$("${DC[@]}" ps -q check)

min_clock() {  # the live minimum clock of shard `ps` (empty while it does not answer)
  "$PS_CLI" status --json --server 127.0.0.1:50051 --timeout-s 2 2>/dev/null \
    | python3 -c 'import json, sys; print(int(json.load(sys.stdin)["view"].get("min_clock", 0)))' \
    2>/dev/null || true
}

# Wait until the training is under way, then restart the `ps` shard mid-run.
deadline=$(( $(date +%s) + 300 ))
while :; do
  c=$(min_clock)
  [ -n "$c" ] && [ "$c" -ge "$RESTART_AT_CLOCK" ] && break
  if [ "$(date +%s)" -gt "$deadline" ]; then echo "compose-ci: training never reached clock $RESTART_AT_CLOCK" >&2; exit 1; fi
  sleep 0.5
done
phase "training-reached-clock-$c" "$t_up"
t=$(date +%s)
"${DC[@]}" restart -t 10 ps
until "$PS_CLI" health --server 127.0.0.1:50051 --timeout-s 1 >/dev/null 2>&1; do
  if [ $(( $(date +%s) - t )) -gt 60 ]; then echo "compose-ci: ps did not come back" >&2; exit 1; fi
  sleep 0.2
done
phase "ps-restart-until-serving" "$t"
# Recovery: the restarted shard restored its checkpoint (+ write-ahead log) and training went on.
t=$(date +%s)
after=""
until [ -n "$after" ] && [ "$after" -gt "$c" ]; do
  if [ $(( $(date +%s) - t )) -gt 60 ]; then echo "compose-ci: training did not resume after the restart" >&2; exit 1; fi
  sleep 0.2
  after=$(min_clock)
done
phase "training-resumed-past-clock-$c" "$t"
"${DC[@]}" logs --no-color ps | grep -E "restored checkpoint|replayed" \
  || { echo "compose-ci: ps did not restore its state after the restart" >&2; exit 1; }

verdict=$($DOCKER wait "$check_id")
phase "cluster-run" "$t_up"
"${DC[@]}" logs --no-color check | tail -n 3
for w in worker-0 worker-1 worker-2 worker-3; do
  restarts=$($DOCKER inspect -f '{{.RestartCount}}' "$("${DC[@]}" ps -q "$w")")
  [ "$restarts" = 0 ] || { echo "compose-ci: $w was restarted ($restarts)" >&2; exit 1; }
done
# The rank servers' Prometheus endpoints (--metrics-port 9161..9164) counted the demo's transfers.
for port in 9161 9162 9163 9164; do
  python3 - "$port" <<'PY' || { echo "compose-ci: rank-server metrics on :$port missing transfers" >&2; exit 1; }
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
moved = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("paramserver_rank_transfer_bytes_total{"))
print(f"compose-ci: rank-server :{sys.argv[1]} transfer bytes {moved:.0f}")
sys.exit(0 if moved > 0 else 1)
PY
done
echo "compose-ci: check job exit code $verdict"
exit "$verdict"
