#!/bin/bash
# Local Prometheus (Debian's 2.42) scraping one target every second, for nantrace agent
# integration tests. Run as root.
#
#   scripts/prometheus-local.sh up TARGET_HOSTPORT [PORT]   # e.g. up 127.0.0.1:9400 ; PORT default 19090
#   scripts/prometheus-local.sh query 'PROMQL'              # GET /api/v1/query, prints the JSON
#   scripts/prometheus-local.sh wait 'PROMQL' [SECONDS]     # poll until the query returns a non-empty result (default 30 s)
#   scripts/prometheus-local.sh down                        # stop it, remove the state dir
#   scripts/prometheus-local.sh install                     # only install prometheus and promtool
#
# It loads nantrace's shipped rules (dist/prometheus/nantrace-rules.yml), so the tests see
# its alerts fire (`ALERTS{alertname="NantraceGpuFatalXid"}`).
# `up` prints `export NANTRACE_PROM_URL=http://127.0.0.1:PORT` on stdout (also in <dir>/env);
# everything else goes to stderr. The scrape job is named `nantrace`, metrics path /metrics.
#
# Environment: NANTRACE_PROM_DIR (default /run/nantrace-prometheus: config, tsdb, log, pid),
#              NANTRACE_PROM_TIMEOUT (seconds `up` waits for /-/ready, default 60),
#              NANTRACE_PROM_KEEP=1 (`down` keeps the dir).
set -euo pipefail

DIR=${NANTRACE_PROM_DIR:-/run/nantrace-prometheus}
RULES=$(cd "$(dirname "$0")/.." && pwd)/dist/prometheus/nantrace-rules.yml
TIMEOUT=${NANTRACE_PROM_TIMEOUT:-60}
PIDF=$DIR/prometheus.pid

log() { echo "prometheus-local: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# GET a URL, body on stdout; non-zero unless HTTP 2xx.
http_get() {
  if command -v curl >/dev/null; then curl -sf --max-time 5 "$1"
  else python3 -c 'import sys,urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1" 2>/dev/null
  fi
}
urlencode() { python3 -c 'import sys,urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$1"; }

install_prometheus() {
  local need=()
  command -v prometheus >/dev/null || need+=(prometheus)
  command -v curl >/dev/null || command -v python3 >/dev/null || need+=(curl)
  [ ${#need[@]} -eq 0 ] && return 0
  log "installing ${need[*]} (apt-get)"
  local before own_policy=0
  before=$(pgrep -x prometheus; pgrep -f '^/usr/bin/prometheus-node-exporter' || true)
  # No systemd here: postinst's invoke-rc.d would run /etc/init.d/prometheus start. A policy-rc.d
  # exiting 101 forbids it (Docker-style images already have one; only add ours if absent).
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; own_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  # --no-install-recommends keeps prometheus-node-exporter (a Recommends) out.
  apt-get install -y -q --no-install-recommends "${need[@]}" >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends "${need[@]}" >&2; }
  if [ $own_policy = 1 ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
  local after pid
  after=$(pgrep -x prometheus; pgrep -f '^/usr/bin/prometheus-node-exporter' || true)
  for pid in $(comm -13 <(echo "$before" | sort) <(echo "$after" | sort)); do
    log "stopping pid $pid ($(cat /proc/$pid/comm 2>/dev/null)) started by the package install"
    kill "$pid" 2>/dev/null || true
  done
}

alive() {
  local pid
  [ -s "$PIDF" ] || return 1
  pid=$(tr -dc 0-9 < "$PIDF"); [ -n "$pid" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = prometheus ] || return 1
  echo "$pid"
}

stop() {
  local pid i
  pid=$(alive) || { rm -f "$PIDF"; return 0; }
  log "stopping prometheus (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then log "still alive after 10 s, SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$PIDF"
}

port() { cat "$DIR/port" 2>/dev/null || echo "${NANTRACE_PROM_PORT:-19090}"; }

cmd_up() {
  local target=${1:-} port=${2:-19090} t0
  [ -n "$target" ] || die "usage: $0 up TARGET_HOSTPORT [PORT]"
  t0=$(date +%s.%N)
  install_prometheus
  mkdir -p "$DIR/data"
  cat > "$DIR/prometheus.yml.new" <<EOF
# Written by scripts/prometheus-local.sh
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
# The alerting and recording rules nantrace ships (dist/prometheus/nantrace-rules.yml).
rule_files:
  - '$RULES'
scrape_configs:
  - job_name: nantrace
    static_configs:
      - targets: ['$target']
EOF
  if alive >/dev/null; then
    if cmp -s "$DIR/prometheus.yml.new" "$DIR/prometheus.yml" && [ "$(port)" = "$port" ]; then
      rm -f "$DIR/prometheus.yml.new"
    else
      log "config or port changed; restarting"; stop
    fi
  fi
  [ -e "$DIR/prometheus.yml.new" ] && mv "$DIR/prometheus.yml.new" "$DIR/prometheus.yml"
  echo "$port" > "$DIR/port"
  if ! alive >/dev/null; then
    log "starting prometheus on 127.0.0.1:$port scraping $target"
    setsid prometheus --config.file="$DIR/prometheus.yml" --storage.tsdb.path="$DIR/data" \
      --storage.tsdb.retention.time=1d --web.listen-address="127.0.0.1:$port" \
      </dev/null >>"$DIR/prometheus.log" 2>&1 9>&- &
    echo $! > "$PIDF"
  fi
  local deadline=$(( $(date +%s) + TIMEOUT ))
  until http_get "http://127.0.0.1:$port/-/ready" >/dev/null; do
    if ! alive >/dev/null || [ "$(date +%s)" -ge "$deadline" ]; then
      log "prometheus not ready on 127.0.0.1:$port"; echo "----- tail $DIR/prometheus.log" >&2
      tail -n 30 "$DIR/prometheus.log" >&2; exit 1
    fi
    sleep 0.2
  done
  echo "export NANTRACE_PROM_URL=http://127.0.0.1:$port" > "$DIR/env"
  log "ready in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s (pid $(alive))"
  cat "$DIR/env"
}

cmd_down() {
  stop
  if [ "${NANTRACE_PROM_KEEP:-0}" = 1 ]; then log "down; kept $DIR"
  elif [ -d "$DIR" ]; then rm -rf "$DIR" "$DIR.lock"; log "down; removed $DIR"
  else rm -f "$DIR.lock"; log "down (nothing was running)"; fi
}

cmd_query() {
  [ -n "${1:-}" ] || die "usage: $0 query PROMQL"
  http_get "http://127.0.0.1:$(port)/api/v1/query?query=$(urlencode "$1")" || die "query failed (is it up?)"
  echo
}

cmd_wait() {
  [ -n "${1:-}" ] || die "usage: $0 wait PROMQL [SECONDS]"
  local q=$1 secs=${2:-30} deadline out
  deadline=$(( $(date +%s) + secs ))
  while :; do
    out=$(http_get "http://127.0.0.1:$(port)/api/v1/query?query=$(urlencode "$q")" || true)
    case "$out" in *'"result":[{'*) echo "$out"; return 0 ;; esac
    [ "$(date +%s)" -lt "$deadline" ] || { log "no result for '$q' after ${secs}s; last answer: ${out:-none}"; exit 1; }
    sleep 0.5
  done
}

[ "$(id -u)" = 0 ] || [ "${1:-}" = query ] || [ "${1:-}" = wait ] || die "must run as root"
if [ "${1:-}" != query ] && [ "${1:-}" != wait ]; then
  mkdir -p "$(dirname "$DIR")"
  # prometheus is started with 9>&- so it does not inherit (and hold) this lock.
  exec 9>"$DIR.lock"
  flock -w 60 9 || die "another prometheus-local.sh holds $DIR.lock"
fi

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  install) install_prometheus ;;
  down) cmd_down ;;
  query) shift; cmd_query "$@" ;;
  wait) shift; cmd_wait "$@" ;;
  *) echo "usage: $0 up TARGET_HOSTPORT [PORT] | install | down | query PROMQL | wait PROMQL [SECONDS]" >&2; exit 2 ;;
esac
