#!/usr/bin/env bash
# Kafka Connect for the local stack: one distributed worker on the stack's Kafka, running
# Apache Kafka's connect-runtime of the broker's version, with these plugins on its plugin path
# (all from Maven Central, descriptors in stack/connect/*/pom.xml):
#   debezium-postgres  Debezium PostgreSQL source (pgoutput)
#   debezium-jdbc      Debezium JDBC sink (PostgreSQL driver only)
#   mongodb            MongoDB Kafka connector (sink and source)
#   iceberg            Apache Iceberg sink (with iceberg-parquet and hadoop-common)
#
#   connect.sh up | down | status | fetch
#
# `make stack-up` starts it when TWOPHASE_STACK_CONNECT=1 (Kafka must be up; stack.sh starts
# it first). `stack.sh down` stops it. Writes $TWOPHASE_STACK_DIR/connect.env.
#
# Environment (all optional, besides stack.sh's):
#   TWOPHASE_CONNECT_PORT (8083)   REST API on 127.0.0.1
#   TWOPHASE_CONNECT_HEAP (512m)
set -euo pipefail

CONNECT_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The stack's directories, ports, pins (KAFKA_VERSION) and helpers (fetch_jars, spawn, ...).
# shellcheck source=stack/stack.sh
source "$CONNECT_HERE/stack.sh"

CONNECT_PORT=${TWOPHASE_CONNECT_PORT:-8083}
CONNECT_HEAP=${TWOPHASE_CONNECT_HEAP:-512m}
CONNECT_URL=http://127.0.0.1:$CONNECT_PORT
CONNECT_DIR=$STACK_DIR/connect
CONNECT_PROPS=$CONNECT_DIR/worker.properties
CONNECT_PID=$RUN_DIR/connect.pid
CONNECT_LOG=$LOG_DIR/connect.log
CONNECT_ENV=$STACK_DIR/connect.env
CONNECT_JARS=$CACHE_DIR/jars/connect/runtime
CONNECT_PLUGINS=$CACHE_DIR/jars/connect/plugins
CONNECT_PLUGIN_NAMES=(debezium-postgres debezium-jdbc mongodb iceberg)
# The worker's group and internal topics; one worker per stack, so fixed names are fine.
CONNECT_GROUP=twophase-connect

connect_pid() { live_pid "$CONNECT_PID" "ConnectDistributed $CONNECT_PROPS"; }

connect_fetch() {
  fetch_jars "$CONNECT_HERE/connect/runtime/pom.xml" "$CONNECT_JARS" -Dkafka.version="$KAFKA_VERSION"
  local name
  for name in "${CONNECT_PLUGIN_NAMES[@]}"; do
    # One directory per plugin under plugin.path: each gets its own class loader, so their
    # different Jackson / Avro / slf4j versions never meet.
    fetch_jars "$CONNECT_HERE/connect/$name/pom.xml" "$CONNECT_PLUGINS/$name"
  done
}

# The REST API answers and lists the plugins: the worker has joined its group and scanned
# the plugin path.
connect_ready() {
  curl -fsS --max-time 5 "$CONNECT_URL/connector-plugins" 2>/dev/null | grep -q PostgresConnector
}

connect_write_env() {
  cat >"$CONNECT_ENV.tmp" <<EOF
# Written by stack/connect.sh up: where Kafka Connect listens. Sourceable.
TWOPHASE_CONNECT_URL='$CONNECT_URL'
TWOPHASE_CONNECT_LOG='$CONNECT_LOG'
TWOPHASE_CONNECT_PLUGIN_PATH='$CONNECT_PLUGINS'
EOF
  mv "$CONNECT_ENV.tmp" "$CONNECT_ENV"
}

connect_start() {
  local pid
  if pid=$(connect_pid); then
    log "connect: already running (pid $pid)"
    connect_write_env
    return 0
  fi
  need_java
  command -v curl >/dev/null 2>&1 || die "curl not found: connect.sh polls the worker's REST API with it"
  connect_fetch
  kafka_pid >/dev/null || die "connect: Kafka is not running; run \`make stack-up\` first"
  require_port_free "$CONNECT_PORT" "Kafka Connect (TWOPHASE_CONNECT_PORT)"
  mkdir -p "$CONNECT_DIR"
  cat >"$CONNECT_PROPS" <<EOF
# Written by stack/connect.sh on every start.
bootstrap.servers=$(kafka_bootstrap)
group.id=$CONNECT_GROUP
config.storage.topic=_${CONNECT_GROUP}-configs
offset.storage.topic=_${CONNECT_GROUP}-offsets
status.storage.topic=_${CONNECT_GROUP}-status
# One replica per broker (TWOPHASE_KAFKA_BROKERS: 1 or 3).
config.storage.replication.factor=$KAFKA_BROKERS
offset.storage.replication.factor=$KAFKA_BROKERS
status.storage.replication.factor=$KAFKA_BROKERS
# Connectors that want another converter say so in their own config.
key.converter=org.apache.kafka.connect.json.JsonConverter
value.converter=org.apache.kafka.connect.json.JsonConverter
# Source offsets every second instead of every minute: a restarted worker in a test
# re-sends at most a second of changes.
offset.flush.interval.ms=1000
listeners=http://127.0.0.1:$CONNECT_PORT
rest.advertised.host.name=127.0.0.1
rest.advertised.port=$CONNECT_PORT
plugin.path=$CONNECT_PLUGINS
EOF
  touch "$CONNECT_LOG"
  # 8>&- : the worker must not inherit connect.sh's lock, or the next connect.sh waits forever.
  spawn "$CONNECT_LOG" "$CONNECT_PID" java -Xms128m -Xmx"$CONNECT_HEAP" -XX:+UseG1GC \
    -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$CONNECT_HERE/kafka/log4j2.properties" \
    -cp "$CONNECT_JARS/*" org.apache.kafka.connect.cli.ConnectDistributed "$CONNECT_PROPS" 8>&-
  pid=$(head -n1 "$CONNECT_PID")
  local i t0=$SECONDS
  for ((i = 0; i < START_TIMEOUT; i++)); do
    kill -0 "$pid" 2>/dev/null || { show_log_tail "$CONNECT_LOG"; die "connect: exited during start-up (log: $CONNECT_LOG)"; }
    if connect_ready; then
      connect_write_env
      log "connect: up on $CONNECT_URL in $((SECONDS - t0))s (pid $pid, log $CONNECT_LOG)"
      return 0
    fi
    sleep 1
  done
  show_log_tail "$CONNECT_LOG"
  die "connect: REST API not answering on $CONNECT_URL after ${START_TIMEOUT}s (log: $CONNECT_LOG)"
}

connect_stop() { # [KILL]
  stop_pid "$CONNECT_PID" "ConnectDistributed $CONNECT_PROPS" connect "${1:-TERM}"
  rm -f "$CONNECT_ENV"
}

connect_status() {
  status_line connect "$(connect_pid || true)" "$CONNECT_PORT" "$CONNECT_LOG"
}

connect_lock() {
  # Its own lock: `stack.sh up` holds the stack's lock while it runs `connect.sh up`.
  mkdir -p "$STACK_DIR" "$RUN_DIR" "$LOG_DIR" "$CACHE_DIR"
  exec 8>"$STACK_DIR/.connect.lock"
  flock 8
}

case "${1:-}" in
  up) connect_lock; connect_start ;;
  down) connect_lock; connect_stop TERM ;;
  status) connect_status ;;
  fetch) connect_lock; need_java; connect_fetch ;;
  *)
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
    exit 2
    ;;
esac
