#!/usr/bin/env bash
# The local stack twophase's tests run against: Kafka (KRaft), PostgreSQL, SecantusDB
# (a MongoDB-protocol server), Apicurio Registry (a schema registry with the Confluent API) and
# MinIO (S3) on 127.0.0.1, plus the Spark Kafka connector jars. Everything
# is installed by this script from package registries, so a fresh machine needs only
# Java 17, Maven, Python 3, Go and curl.
#
#   stack.sh up | down | status | restart-kafka [--kill] | restart-pg [--kill] | restart-mongo [--kill]
#   stack.sh restart-minio [--kill]
#   stack.sh start SERVICE...            only these of kafka pg mongo registry minio, e.g. a
#                                        private Kafka for a test; writes stack.env as up does
#   stack.sh kill-broker N | stop-broker N [--kill] | start-broker N | restart-broker N [--kill]
#                                        one Kafka node (N = 1..TWOPHASE_KAFKA_BROKERS)
#   stack.sh kafka-run CLASS [ARGS...]   run a Kafka tool, e.g.
#       stack.sh kafka-run org.apache.kafka.tools.consumer.group.ConsumerGroupCommand \
#           --bootstrap-server 127.0.0.1:9092 --describe --all-groups
#
# Environment (all optional):
#   TWOPHASE_STACK_DIR   data, logs, pid files, stack.env   (default <repo>/.stack)
#   TWOPHASE_CACHE_DIR   maven repo, jars, SecantusDB venv  (default ~/.cache/twophase)
#   TWOPHASE_KAFKA_PORT (9092)  TWOPHASE_KAFKA_CONTROLLER_PORT (9093)
#   TWOPHASE_KAFKA_BROKERS (1)  1, or 3: three combined broker+controller nodes, node N on
#       TWOPHASE_KAFKA_PORT + 100*(N-1) and TWOPHASE_KAFKA_CONTROLLER_PORT + 100*(N-1)
#       (9092/9093, 9192/9193, 9292/9293), replication factor 3, min.insync.replicas 2.
#       Give it to every stack.sh command of that stack (down stops either layout).
#   TWOPHASE_KAFKA_EXTRA_LISTENERS   NAME:listen_port:advertised_port[,...], e.g.
#       P0:29192:29292 = a PLAINTEXT listener P0 on 127.0.0.1:29192 that advertises
#       127.0.0.1:29292 (a proxy there forwarding to 29192 stays in every client connection);
#       with three brokers node N has each listener at both ports + 100*(N-1)
#   TWOPHASE_PG_PORT (25432)    TWOPHASE_MONGO_PORT (27018)
#       (every default below 32768: servers restarted during a run must find their port
#       free, and Linux gives outgoing connections ports from 32768-60999)
#   TWOPHASE_REGISTRY_PORT (8081)   TWOPHASE_REGISTRY_HEAP (256m)
#   TWOPHASE_MINIO_PORT (9000)  MinIO's S3 API (its console is off)
#   TWOPHASE_KAFKA_HEAP (1g)    TWOPHASE_PYTHON (python3, for the SecantusDB venv)
#   TWOPHASE_MONGO_TXN_LIFETIME_S (60)   idle MongoDB transactions are aborted after this
#   TWOPHASE_MONGO_REAP_INTERVAL_S (5)   how often the reaper makes SecantusDB check
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")

# Pinned versions. pyspark's pin lives in pyproject.toml and the connector must match it.
KAFKA_VERSION=4.1.2
SECANTUS_VERSION=0.7.0b3
# The version lives in registry/pom.xml (why this one: see the comment there).
REGISTRY_VERSION=$(sed -n 's|^ *<apicurio.version>\([^<]*\)</apicurio.version>.*|\1|p' "$HERE/registry/pom.xml" | head -n1)
SPARK_VERSION=$(sed -n 's/^[^#]*"pyspark==\([^"]*\)".*/\1/p' "$REPO/pyproject.toml" | head -n1)

STACK_DIR=$(realpath -m "${TWOPHASE_STACK_DIR:-$REPO/.stack}")
CACHE_DIR=$(realpath -m "${TWOPHASE_CACHE_DIR:-${HOME:-/root}/.cache/twophase}")
KAFKA_PORT=${TWOPHASE_KAFKA_PORT:-9092}
CONTROLLER_PORT=${TWOPHASE_KAFKA_CONTROLLER_PORT:-9093}
PG_PORT=${TWOPHASE_PG_PORT:-25432}
MONGO_PORT=${TWOPHASE_MONGO_PORT:-27018}
KAFKA_HEAP=${TWOPHASE_KAFKA_HEAP:-1g}
KAFKA_BROKERS=${TWOPHASE_KAFKA_BROKERS:-1}
REGISTRY_PORT=${TWOPHASE_REGISTRY_PORT:-8081}
# Idle at ~230 MB RSS with this heap; the stack's schemas are tiny.
REGISTRY_HEAP=${TWOPHASE_REGISTRY_HEAP:-256m}
PYTHON=${TWOPHASE_PYTHON:-python3}
# mongod's transactionLifetimeLimitSeconds default: the tests see the recovery time a real
# deployment has, not a shorter one the product could come to depend on.
MONGO_TXN_LIFETIME_S=${TWOPHASE_MONGO_TXN_LIFETIME_S:-60}
MONGO_REAP_INTERVAL_S=${TWOPHASE_MONGO_REAP_INTERVAL_S:-5}

RUN_DIR=$STACK_DIR/run
LOG_DIR=$STACK_DIR/logs
KAFKA_DIR=$STACK_DIR/kafka
PG_DATA=$STACK_DIR/pg/data
MONGO_DIR=$STACK_DIR/mongo
KAFKA_JARS=$CACHE_DIR/jars/kafka
SPARK_JARS_DIR=$CACHE_DIR/jars/spark-kafka
SECANTUS_VENV=$CACHE_DIR/secantus-venv
REGISTRY_BUILD=$CACHE_DIR/registry/apicurio-$REGISTRY_VERSION
M2=$CACHE_DIR/m2

KAFKA_LOG=$LOG_DIR/kafka.log
PG_LOG=$LOG_DIR/postgres.log
MONGO_LOG=$LOG_DIR/mongo.log
REAPER_LOG=$LOG_DIR/mongo-reaper.log
REGISTRY_LOG=$LOG_DIR/registry.log

PG_USER=twophase
PG_PASSWORD=twophase
PG_DB=twophase
PG_DSN="postgresql://$PG_USER:$PG_PASSWORD@127.0.0.1:$PG_PORT/$PG_DB"
# SecantusDB answers `hello` as the primary of a one-node replica set named "secantus";
# naming the set makes pymongo use replica-set topology, which transactions require.
MONGO_URI="mongodb://127.0.0.1:$MONGO_PORT/?replicaSet=secantus"

# How long to wait for a service to answer. Kafka on 2 busy cores has been seen to need
# ~15 s; the rest start in a few seconds. Generous, because a slow CI machine is not a bug.
START_TIMEOUT=120
# How long a clean shutdown may take before SIGKILL (Kafka's controlled shutdown and
# WiredTiger's checkpoint both finish well inside this).
STOP_TIMEOUT=60

log() { printf 'stack: %s\n' "$*" >&2; }
die() { printf 'stack: error: %s\n' "$*" >&2; exit 1; }

case "$STACK_DIR$CACHE_DIR" in
  *[[:space:]\'\"\\]*) die "TWOPHASE_STACK_DIR/TWOPHASE_CACHE_DIR must not contain spaces or quotes" ;;
esac
[[ $KAFKA_BROKERS == 1 || $KAFKA_BROKERS == 3 ]] ||
  die "TWOPHASE_KAFKA_BROKERS=$KAFKA_BROKERS: want 1 or 3"
[[ -n $SPARK_VERSION ]] || die "could not read the pyspark==X pin from $REPO/pyproject.toml"
[[ -n $REGISTRY_VERSION ]] || die "could not read <apicurio.version> from $HERE/registry/pom.xml"

# ---------------------------------------------------------------------------- helpers

# Something accepts connections on 127.0.0.1:$1.
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Who listens on a port, for error messages; empty when ss is missing.
port_owner() {
  command -v ss >/dev/null 2>&1 || return 0
  ss -Hltnp "sport = :$1" 2>/dev/null | sed -n 's/.*users:(\(.*\))$/\1/p' | head -n1
}

require_port_free() { # port service
  if port_open "$1"; then
    local who
    who=$(port_owner "$1")
    die "port $1 needed by $2 is already in use by another process${who:+: $who}; stop it or set the TWOPHASE_*_PORT variable"
  fi
}

cmdline_of() { tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline" || true; }

# Prints the pid in pid file $1 when that process is alive and its command line contains
# $2 (so a recycled pid is never taken for ours); fails otherwise.
live_pid() {
  local pid
  [[ -f $1 ]] || return 1
  pid=$(head -n1 "$1")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ $(cmdline_of "$pid") == *"$2"* ]] || return 1
  # A zombie still has a /proc entry but an empty cmdline, so the match above rejects it.
  printf '%s\n' "$pid"
}

# Waits for pid $1 to exit; SIGKILLs it after $2 seconds.
wait_exit() {
  local pid=$1 limit=$2 i
  for ((i = 0; i < limit * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  log "pid $pid did not stop within ${limit}s, sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  die "pid $pid survived SIGKILL"
}

stop_pid() { # pidfile pattern name signal
  local pid
  if pid=$(live_pid "$1" "$2"); then
    log "$3: stopping pid $pid"
    kill "-$4" "$pid" 2>/dev/null || true
    wait_exit "$pid" "$STOP_TIMEOUT"
  fi
  rm -f "$1"
}

show_log_tail() {
  log "last lines of $1:"
  tail -n 30 "$1" >&2 || true
}

# Starts a long-running server detached from this shell (own session, no terminal, so a
# Ctrl-C in `make` does not reach it), appending its output to $1, and records its pid in $2.
spawn() { # logfile pidfile cmd...
  local logfile=$1 pidfile=$2
  shift 2
  printf '\n==== %s stack.sh starting: %s\n' "$(date -Is)" "$*" >>"$logfile"
  # 9>&- : the server must not inherit the stack lock, or the next stack.sh waits forever.
  setsid "$@" >>"$logfile" 2>&1 </dev/null 9>&- &
  printf '%s\n' "$!" >"$pidfile"
}

sha() { cat "$@" | sha1sum | cut -c1-12; }

need_java() {
  command -v java >/dev/null 2>&1 || die "java not found: Kafka needs Java 17+ (Debian: apt-get install openjdk-17-jre-headless)"
  local v
  v=$(java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java\.specification\.version = //p')
  [[ ${v%%.*} -ge 17 ]] || die "java $v found; Kafka 4 and Spark 4 need Java 17+"
}

need_mvn() {
  command -v mvn >/dev/null 2>&1 || die "mvn not found: Maven fetches the Kafka and Spark connector jars (Debian: apt-get install maven)"
}

# Copies a pom's runtime classpath into $2, unless $2 already holds it (stamp = pom + args).
fetch_jars() { # pom dest extra-mvn-args...
  local pom=$1 dest=$2
  shift 2
  local stamp
  stamp="$dest/.complete-$(printf '%s %s' "$(sha "$pom")" "$*" | sha1sum | cut -c1-12)"
  [[ -f $stamp ]] && return 0
  need_mvn
  log "fetching $(basename "$(dirname "$pom")") jars with Maven into $dest (first run only)"
  local tmp="$dest.tmp.$$"
  rm -rf "$tmp"
  local mvn_log=$LOG_DIR/maven.log
  mkdir -p "$LOG_DIR"
  if ! mvn -B -Dstyle.color=never -f "$pom" -Dmaven.repo.local="$M2" "$@" \
      dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp" >"$mvn_log" 2>&1; then
    rm -rf "$tmp"
    grep -E '^\[ERROR\]' "$mvn_log" | head -n 5 >&2 || true
    die "Maven could not fetch the jars for $pom (full output: $mvn_log)"
  fi
  rm -rf "$dest"
  mv "$tmp" "$dest"
  touch "$stamp"
}

# ---------------------------------------------------------------------------- Kafka

# One combined broker+controller by default. TWOPHASE_KAFKA_BROKERS=3: three combined nodes, a
# 3-voter controller quorum, node N (1..3) on TWOPHASE_KAFKA_PORT + 100*(N-1) and
# TWOPHASE_KAFKA_CONTROLLER_PORT + 100*(N-1) (defaults 9092/9093, 9192/9193, 9292/9293: a
# stride of 100 keeps every client port clear of every controller port).
KAFKA_NODE_STRIDE=100

KAFKA_PID=$RUN_DIR/kafka.pid
KAFKA_PROPS=$KAFKA_DIR/server.properties

# Sets NODE_NAME, NODE_DIR, NODE_PROPS, NODE_PID, NODE_LOG, NODE_PORT and NODE_CONTROLLER_PORT
# for node $1 of layout $2 (default: the configured one). Layout 1 keeps the one broker's
# paths (kafka/, run/kafka.pid, logs/kafka.log); layout 3 has kafka/node-N, kafka-N.{pid,log}.
kafka_node() { # node [layout]
  local layout=${2:-$KAFKA_BROKERS}
  NODE_PORT=$((KAFKA_PORT + KAFKA_NODE_STRIDE * ($1 - 1)))
  NODE_CONTROLLER_PORT=$((CONTROLLER_PORT + KAFKA_NODE_STRIDE * ($1 - 1)))
  if ((layout == 1)); then
    NODE_NAME=kafka NODE_DIR=$KAFKA_DIR NODE_PID=$KAFKA_PID NODE_LOG=$KAFKA_LOG
  else
    NODE_NAME=kafka-$1 NODE_DIR=$KAFKA_DIR/node-$1 NODE_PID=$RUN_DIR/kafka-$1.pid
    NODE_LOG=$LOG_DIR/kafka-$1.log
  fi
  NODE_PROPS=$NODE_DIR/server.properties
}

# The pid of the node kafka_node chose, when it runs.
kafka_node_pid() { live_pid "$NODE_PID" "kafka.Kafka $NODE_PROPS"; }

# The pid of the one broker (of node 1 of three) when every node runs; fails otherwise.
kafka_pid() {
  local n pid=
  for ((n = KAFKA_BROKERS; n >= 1; n--)); do
    kafka_node "$n"
    pid=$(kafka_node_pid) || return 1
  done
  printf '%s\n' "$pid"
}

# Every node's client address: what stack.env's TWOPHASE_KAFKA_BOOTSTRAP names.
kafka_bootstrap() {
  local n out=
  for ((n = 1; n <= KAFKA_BROKERS; n++)); do
    kafka_node "$n"
    out+="${out:+,}127.0.0.1:$NODE_PORT"
  done
  printf '%s' "$out"
}

# TWOPHASE_KAFKA_EXTRA_LISTENERS=NAME:listen_port:advertised_port[,...]: more PLAINTEXT
# listeners on 127.0.0.1:listen_port that advertise 127.0.0.1:advertised_port, so a client that
# bootstraps through a proxy (Toxiproxy) on advertised_port forwarding to listen_port is told to
# come back through that proxy, and only that client's traffic passes it. With three brokers
# every node has every listener, node N at both ports + KAFKA_NODE_STRIDE*(N-1): a client that
# connected on listener NAME is given each node's NAME address, so one proxy per node keeps all
# of its connections on proxies. Parsed into EXTRA_ENTRIES (name lport aport); kafka_extra N
# renders node N's tails of listeners, advertised.listeners and the protocol map.
EXTRA_ENTRIES=()
kafka_parse_extra_listeners() {
  local spec=${TWOPHASE_KAFKA_EXTRA_LISTENERS:-} entry name lport aport n names=' '
  local top=$((KAFKA_NODE_STRIDE * (KAFKA_BROKERS - 1)))
  local -a entries
  EXTRA_ENTRIES=()
  [[ -n $spec ]] || return 0
  local var="TWOPHASE_KAFKA_EXTRA_LISTENERS=$spec"
  [[ $spec != ,* && $spec != *, && $spec != *,,* ]] || die "$var: an empty entry; want NAME:listen_port:advertised_port[,...]"
  IFS=, read -r -a entries <<<"$spec"
  for entry in "${entries[@]}"; do
    [[ $entry =~ ^([A-Z][A-Z0-9_]*):([0-9]{1,5}):([0-9]{1,5})$ ]] ||
      die "$var: '$entry' is not NAME:listen_port:advertised_port (NAME in capitals, e.g. P0:29192:29292)"
    name=${BASH_REMATCH[1]} lport=$((10#${BASH_REMATCH[2]})) aport=$((10#${BASH_REMATCH[3]}))
    case $name in
      PLAINTEXT | CONTROLLER) die "$var: $name is a listener of the stack's own; choose another name" ;;
    esac
    [[ $names != *" $name "* ]] || die "$var: listener $name is named twice"
    ((lport >= 1 && lport + top <= 65535 && aport >= 1 && aport + top <= 65535)) ||
      die "$var: '$entry' has a port outside 1-65535$( ((top == 0)) || echo " (node $KAFKA_BROKERS adds $top)")"
    names+="$name "
    EXTRA_ENTRIES+=("$name $lport $aport")
  done
  # No port twice, every node's shifted ones included: a node's own ports, each listener's
  # listen and advertised port (a proxy could not bind where a node listens).
  local -A taken=()
  local p what
  for ((n = 1; n <= KAFKA_BROKERS; n++)); do
    kafka_node "$n"
    taken[$NODE_PORT]="Kafka node $n" taken[$NODE_CONTROLLER_PORT]="Kafka node $n's controller"
  done
  for entry in "${EXTRA_ENTRIES[@]}"; do
    read -r name lport aport <<<"$entry"
    for ((n = 1; n <= KAFKA_BROKERS; n++)); do
      for what in "listen $lport" "advertised $aport"; do
        p=$((${what#* } + KAFKA_NODE_STRIDE * (n - 1)))
        [[ -z ${taken[$p]:-} || ${taken[$p]} == "$name node $n" ]] ||
          die "$var: port $p would be both ${taken[$p]}'s and listener $name's on node $n$( ((KAFKA_BROKERS == 1)) || echo " (node N adds $KAFKA_NODE_STRIDE*(N-1) to both ports)")"
        taken[$p]="$name node $n"
      done
    done
  done
}

# Node $1's extra listeners: EXTRA_LISTENERS, EXTRA_ADVERTISED, EXTRA_PROTOCOLS (tails of the
# properties) and EXTRA_PORTS (NAME:port, its listen ports).
EXTRA_LISTENERS='' EXTRA_ADVERTISED='' EXTRA_PROTOCOLS='' EXTRA_PORTS=()
kafka_extra() { # node
  local entry name lport aport plus=$((KAFKA_NODE_STRIDE * ($1 - 1)))
  EXTRA_LISTENERS='' EXTRA_ADVERTISED='' EXTRA_PROTOCOLS='' EXTRA_PORTS=()
  for entry in ${EXTRA_ENTRIES[@]+"${EXTRA_ENTRIES[@]}"}; do
    read -r name lport aport <<<"$entry"
    EXTRA_LISTENERS+=",$name://127.0.0.1:$((lport + plus))"
    EXTRA_ADVERTISED+=",$name://127.0.0.1:$((aport + plus))"
    EXTRA_PROTOCOLS+=",$name:PLAINTEXT"
    EXTRA_PORTS+=("$name:$((lport + plus))")
  done
}

# Nodes of the other layout still running in this stack dir would clash on ports: say which
# setting is off instead of failing on a busy port.
kafka_check_layout() {
  local other=3 n
  ((KAFKA_BROKERS == 1)) || other=1
  for ((n = 1; n <= other; n++)); do
    kafka_node "$n" "$other"
    if kafka_node_pid >/dev/null; then
      die "a $other-broker Kafka runs in $STACK_DIR ($NODE_NAME); set TWOPHASE_KAFKA_BROKERS=$other, or stop it first with \`stack.sh down\`"
    fi
  done
}

kafka_require_ports() { # nodes...
  local n p
  for n in "$@"; do
    kafka_node "$n"
    kafka_extra "$n"
    if ((KAFKA_BROKERS == 1)); then
      require_port_free "$KAFKA_PORT" "Kafka (TWOPHASE_KAFKA_PORT)"
      require_port_free "$CONTROLLER_PORT" "the Kafka controller (TWOPHASE_KAFKA_CONTROLLER_PORT)"
    else
      local plus=$((KAFKA_NODE_STRIDE * (n - 1)))
      require_port_free "$NODE_PORT" "Kafka node $n (TWOPHASE_KAFKA_PORT + $plus)"
      require_port_free "$NODE_CONTROLLER_PORT" "Kafka node $n's controller (TWOPHASE_KAFKA_CONTROLLER_PORT + $plus)"
    fi
    for p in ${EXTRA_PORTS[@]+"${EXTRA_PORTS[@]}"}; do
      require_port_free "${p#*:}" "Kafka node $n's listener ${p%%:*} (TWOPHASE_KAFKA_EXTRA_LISTENERS)"
    done
  done
}

kafka_jars() {
  fetch_jars "$HERE/kafka/pom.xml" "$KAFKA_JARS" -Dkafka.version="$KAFKA_VERSION"
}

# Tools log warnings only, to stderr, so their stdout stays their answer.
kafka_java() { # main-class args...
  java -Xmx256m -Dlog4j2.configurationFile="$HERE/kafka/log4j2.properties" \
    -Dtwophase.log.level=WARN -Dtwophase.log.target=SYSTEM_ERR -cp "$KAFKA_JARS/*" "$@"
}

# Writes $NODE_PROPS for node $1 (after kafka_node $1), on every start so port changes apply.
kafka_render() { # node
  local voters='' rf=1 min_isr=1 n
  for ((n = 1; n <= KAFKA_BROKERS; n++)); do
    voters+="${voters:+,}$n@127.0.0.1:$((CONTROLLER_PORT + KAFKA_NODE_STRIDE * (n - 1)))"
  done
  # Three brokers: every replicated topic survives one broker down and still takes acks=all.
  ((KAFKA_BROKERS == 1)) || rf=3 min_isr=2
  kafka_extra "$1"
  mkdir -p "$NODE_DIR/data"
  sed -e "s|@NODE_ID@|$1|g" -e "s|@VOTERS@|$voters|g" \
    -e "s|@KAFKA_PORT@|$NODE_PORT|g" -e "s|@CONTROLLER_PORT@|$NODE_CONTROLLER_PORT|g" \
    -e "s|@EXTRA_LISTENERS@|$EXTRA_LISTENERS|g" -e "s|@EXTRA_ADVERTISED@|$EXTRA_ADVERTISED|g" \
    -e "s|@EXTRA_PROTOCOLS@|$EXTRA_PROTOCOLS|g" \
    -e "s|@REPLICATION_FACTOR@|$rf|g" -e "s|@MIN_ISR@|$min_isr|g" \
    -e "s|@DATA_DIR@|$NODE_DIR/data|g" "$HERE/kafka/server.properties.in" >"$NODE_PROPS"
}

# Formats the storage of those of nodes $@ that have none, with the cluster id the other
# nodes already have (every node of a cluster must share it), else a new one.
kafka_format() { # nodes...
  local n cluster_id=''
  for ((n = 1; n <= KAFKA_BROKERS; n++)); do
    kafka_node "$n"
    [[ -f $NODE_DIR/data/meta.properties ]] || continue
    cluster_id=$(sed -n 's/^cluster\.id=//p' "$NODE_DIR/data/meta.properties")
    [[ -n $cluster_id ]] && break
  done
  # Side by side: each is a JVM start, seconds on a busy machine.
  local -A formatting=()
  for n in "$@"; do
    kafka_node "$n"
    [[ -f $NODE_DIR/data/meta.properties ]] && continue
    [[ -n $cluster_id ]] || cluster_id=$(kafka_java kafka.tools.StorageTool random-uuid | tail -n1)
    log "$NODE_NAME: formatting storage (cluster id $cluster_id)"
    kafka_java kafka.tools.StorageTool format --cluster-id "$cluster_id" \
      --config "$NODE_PROPS" >>"$NODE_LOG" 2>&1 9>&- &
    formatting[$n]=$!
  done
  for n in "${!formatting[@]}"; do
    kafka_node "$n"
    wait "${formatting[$n]}" || { show_log_tail "$NODE_LOG"; die "$NODE_NAME: storage format failed"; }
  done
}

kafka_start() { # [node]: every node, or node $1 only
  local n pid todo=()
  kafka_parse_extra_listeners
  kafka_check_layout
  for ((n = 1; n <= KAFKA_BROKERS; n++)); do
    [[ -z ${1:-} || $1 == "$n" ]] || continue
    kafka_node "$n"
    if pid=$(kafka_node_pid); then
      log "$NODE_NAME: already running (pid $pid)"
    else
      todo+=("$n")
    fi
  done
  ((${#todo[@]} > 0)) || return 0
  need_java
  kafka_jars
  kafka_require_ports "${todo[@]}"
  for n in "${todo[@]}"; do
    kafka_node "$n"
    kafka_render "$n"
  done
  kafka_format "${todo[@]}"
  # Every node is spawned before any is waited for: a node of three is "started" only once a
  # majority of the controller quorum runs.
  local -A offset=()
  for n in "${todo[@]}"; do
    kafka_node "$n"
    touch "$NODE_LOG"
    offset[$n]=$(stat -c %s "$NODE_LOG")
    # -Xmx stays modest: the machine has 2 cores and 24 GiB shared with Spark and the tests.
    spawn "$NODE_LOG" "$NODE_PID" java -Xms256m -Xmx"$KAFKA_HEAP" -XX:+UseG1GC \
      -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true \
      -Dlog4j2.configurationFile="$HERE/kafka/log4j2.properties" \
      -cp "$KAFKA_JARS/*" kafka.Kafka "$NODE_PROPS"
  done
  for n in "${todo[@]}"; do
    kafka_node "$n"
    kafka_wait "${offset[$n]}"
  done
}

# Waits for the node kafka_node chose to serve; $1: its log's size before it was spawned.
kafka_wait() { # log-offset
  local pid i
  pid=$(head -n1 "$NODE_PID")
  for ((i = 0; i < START_TIMEOUT * 5; i++)); do
    kill -0 "$pid" 2>/dev/null || { show_log_tail "$NODE_LOG"; die "$NODE_NAME: exited during start-up (log: $NODE_LOG)"; }
    # "Kafka Server started" is logged once the broker is registered and unfenced, i.e. it
    # serves produce/fetch; the offset skips lines from earlier runs in the same log.
    if port_open "$NODE_PORT" && tail -c +"$(($1 + 1))" "$NODE_LOG" | grep -q 'Kafka Server started'; then
      log "$NODE_NAME: up on 127.0.0.1:$NODE_PORT (pid $pid, log $NODE_LOG)"
      return 0
    fi
    sleep 0.2
  done
  show_log_tail "$NODE_LOG"
  die "$NODE_NAME: not answering on 127.0.0.1:$NODE_PORT after ${START_TIMEOUT}s (log: $NODE_LOG)"
}

# Every node of either layout (so `down` leaves none behind after a change of
# TWOPHASE_KAFKA_BROKERS), or node $2 of the configured one. All are signalled before any is
# waited for: a node's controlled shutdown needs the controller quorum, which the others are.
kafka_stop() { # [signal] [node]
  local signal=${1:-TERM} spec pid pids=() pidfiles=()
  local specs=("1:1" "3:1" "3:2" "3:3")
  [[ -z ${2:-} ]] || specs=("$KAFKA_BROKERS:$2")
  for spec in "${specs[@]}"; do
    kafka_node "${spec#*:}" "${spec%%:*}"
    if pid=$(kafka_node_pid); then
      log "$NODE_NAME: stopping pid $pid"
      kill "-$signal" "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
    pidfiles+=("$NODE_PID")
  done
  for pid in ${pids[@]+"${pids[@]}"}; do
    wait_exit "$pid" "$STOP_TIMEOUT"
  done
  rm -f "${pidfiles[@]}"
}

# ---------------------------------------------------------------------------- PostgreSQL

PG_PID=$RUN_DIR/postgres.pid
PG_BIN=

find_pg() {
  local d
  for d in $(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V -r); do
    if [[ -x $d/initdb && -x $d/pg_ctl && -x $d/postgres && -x $d/psql ]]; then
      PG_BIN=$d
      return 0
    fi
  done
  return 1
}

pg_install() {
  find_pg && return 0
  # /usr/local/bin/pg_ctl and friends may be symlinks to a Debian server install, or just a
  # client: only a directory with initdb + postgres counts.
  if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    die "no PostgreSQL server found under /usr/lib/postgresql; install it (Debian: apt-get install postgresql)"
  fi
  log "postgres: installing the Debian postgresql package (first run only)"
  apt-get update -qq >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2 ||
    die "apt-get install postgresql failed"
  find_pg || die "postgresql installed but no initdb under /usr/lib/postgresql/*/bin"
}

# initdb and postgres refuse to run as root: as root, run them as the postgres OS user.
as_pg() {
  if [[ $EUID -eq 0 ]]; then
    # /usr/sbin is not on every root PATH (CI runners, `sudo -E`).
    "$(command -v runuser || echo /usr/sbin/runuser)" -u postgres -- "$@"
  else
    "$@"
  fi
}

pg_pid() { live_pid "$PG_PID" "$PG_DATA"; }

pg_psql() { # sql, against database postgres
  PGPASSWORD=$PG_PASSWORD PGCONNECT_TIMEOUT=5 "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -At \
    -h 127.0.0.1 -p "$PG_PORT" -U "$PG_USER" -d postgres -c "$1"
}

pg_start() {
  local pid
  if pid=$(pg_pid); then
    log "postgres: already running (pid $pid)"
    return 0
  fi
  pg_install
  require_port_free "$PG_PORT" "PostgreSQL (TWOPHASE_PG_PORT)"
  if [[ $EUID -eq 0 ]]; then
    id postgres >/dev/null 2>&1 || die "the postgres OS user is missing (it comes with the postgresql package)"
  fi
  mkdir -p "$(dirname "$PG_DATA")"
  touch "$PG_LOG"
  if [[ $EUID -eq 0 ]]; then
    chown postgres: "$(dirname "$PG_DATA")" "$PG_LOG"
    as_pg test -w "$(dirname "$PG_DATA")" ||
      die "the postgres OS user cannot reach $(dirname "$PG_DATA"); every parent directory needs o+x"
  fi
  if [[ ! -f $PG_DATA/PG_VERSION ]]; then
    log "postgres: initdb $PG_DATA"
    rm -rf "$PG_DATA"
    local pwfile
    pwfile=$(mktemp)
    printf '%s\n' "$PG_PASSWORD" >"$pwfile"
    [[ $EUID -eq 0 ]] && chown postgres: "$pwfile"
    # The bootstrap superuser is the test role itself; TCP logins need its password.
    if ! as_pg "$PG_BIN/initdb" -D "$PG_DATA" -U "$PG_USER" --pwfile="$pwfile" \
        --auth-host=scram-sha-256 --auth-local=peer -E UTF8 --no-locale >>"$PG_LOG" 2>&1; then
      rm -f "$pwfile"
      show_log_tail "$PG_LOG"
      die "postgres: initdb failed (log: $PG_LOG)"
    fi
    rm -f "$pwfile"
    printf "\ninclude_if_exists = 'twophase.conf'\n" >>"$PG_DATA/postgresql.conf"
  fi
  # Rewritten on every start so a changed TWOPHASE_PG_PORT applies to an existing cluster.
  as_pg tee "$PG_DATA/twophase.conf" >/dev/null <<EOF
# Written by stack/stack.sh on every start.
listen_addresses = '127.0.0.1'
port = $PG_PORT
# TCP only: no socket file in /var/run/postgresql to collide with a system cluster.
unix_socket_directories = ''
# Two-phase commit is the point of the PostgreSQL sink; every test worker may hold some.
max_prepared_transactions = 100
max_connections = 200
# Lets the PostgreSQL sink tell when its last part was committed (twophase status).
track_commit_timestamp = on
# Logical decoding (pgoutput) for Debezium's PostgreSQL source (stack/connect.sh). The
# defaults max_replication_slots = 10 and max_wal_senders = 10 leave room for several
# connectors; the extra WAL is small next to the tests' own writes.
wal_level = logical
fsync = on
synchronous_commit = on
log_line_prefix = '%m [%p] %a %q%u@%d '
EOF
  # pg_ctl detaches the server into its own session and -w waits until it accepts logins.
  if ! as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t "$START_TIMEOUT" -s start >&2 9>&-; then
    show_log_tail "$PG_LOG"
    die "postgres: did not start (log: $PG_LOG)"
  fi
  head -n1 "$PG_DATA/postmaster.pid" >"$PG_PID"
  pid=$(pg_pid) || die "postgres: started but its pid in $PG_DATA/postmaster.pid does not match"
  local i
  for ((i = 0; ; i++)); do
    pg_psql 'SELECT 1' >/dev/null 2>&1 && break
    ((i < START_TIMEOUT)) || die "postgres: not accepting logins as $PG_USER (log: $PG_LOG)"
    sleep 1
  done
  if [[ $(pg_psql "SELECT count(*) FROM pg_database WHERE datname = '$PG_DB'") == 0 ]]; then
    pg_psql "CREATE DATABASE $PG_DB" || die "postgres: CREATE DATABASE $PG_DB failed"
  fi
  log "postgres: up on 127.0.0.1:$PG_PORT (pid $pid, log $PG_LOG)"
}

pg_stop() { # [KILL]
  local pid mode=fast
  [[ ${1:-} == KILL ]] && mode=immediate
  if pid=$(pg_pid); then
    find_pg || die "postgres is running (pid $pid) but pg_ctl is gone"
    log "postgres: stopping pid $pid ($mode)"
    as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -m "$mode" -w -t "$STOP_TIMEOUT" -s stop >&2 || true
    wait_exit "$pid" "$STOP_TIMEOUT"
  fi
  rm -f "$PG_PID"
}

# ---------------------------------------------------------------------------- SecantusDB

MONGO_PID=$RUN_DIR/mongo.pid
MONGO_DATA=$MONGO_DIR/data

mongo_pid() { live_pid "$MONGO_PID" "--storage-path $MONGO_DATA"; }

# A test service only: its own venv, never the project's dependencies.
secantus_install() {
  local stamp=$SECANTUS_VENV/.installed-$SECANTUS_VERSION
  [[ -f $stamp && -x $SECANTUS_VENV/bin/secantusd-py ]] && return 0
  command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set TWOPHASE_PYTHON to a Python 3.10+)"
  log "mongo: installing secantusdb==$SECANTUS_VERSION into $SECANTUS_VENV (first run only)"
  rm -rf "$SECANTUS_VENV"
  "$PYTHON" -m venv "$SECANTUS_VENV" || die "could not create a venv with $PYTHON"
  "$SECANTUS_VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "secantusdb==$SECANTUS_VERSION" >&2 || die "pip install secantusdb==$SECANTUS_VERSION failed"
  touch "$stamp"
}

mongo_ping() {
  "$SECANTUS_VENV/bin/python" - "$MONGO_URI" <<'EOF' 2>/dev/null
import sys
import pymongo
client = pymongo.MongoClient(sys.argv[1], serverSelectionTimeoutMS=2000)
client.admin.command("ping")
EOF
}

mongo_start() {
  local pid
  if pid=$(mongo_pid); then
    log "mongo: already running (pid $pid)"
    return 0
  fi
  secantus_install
  require_port_free "$MONGO_PORT" "SecantusDB (TWOPHASE_MONGO_PORT)"
  mkdir -p "$MONGO_DATA"
  # An explicit (empty) config file turns off SecantusDB's search of ./, ~/.secantus and
  # /etc/secantus, so nothing on the machine changes how the test server behaves.
  printf '# Empty on purpose: settings are command-line flags in stack/stack.sh.\n' >"$MONGO_DIR/secantusd.toml"
  [[ $MONGO_TXN_LIFETIME_S =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
    die "TWOPHASE_MONGO_TXN_LIFETIME_S=$MONGO_TXN_LIFETIME_S: want a number of seconds"
  # stack/secantusd.py = secantusd-py with the transaction lifetime set (the daemon has no flag).
  (cd "$MONGO_DIR" && TWOPHASE_MONGO_TXN_LIFETIME_S=$MONGO_TXN_LIFETIME_S \
    spawn "$MONGO_LOG" "$MONGO_PID" "$SECANTUS_VENV/bin/python" "$HERE/secantusd.py" \
    --config "$MONGO_DIR/secantusd.toml" --host 127.0.0.1 --port "$MONGO_PORT" \
    --log-level INFO --storage-path "$MONGO_DATA")
  pid=$(head -n1 "$MONGO_PID")
  local i
  for ((i = 0; i < START_TIMEOUT; i++)); do
    kill -0 "$pid" 2>/dev/null || { show_log_tail "$MONGO_LOG"; die "mongo: exited during start-up (log: $MONGO_LOG)"; }
    if port_open "$MONGO_PORT" && mongo_ping; then
      log "mongo: up on 127.0.0.1:$MONGO_PORT (pid $pid, log $MONGO_LOG)"
      return 0
    fi
    sleep 1
  done
  show_log_tail "$MONGO_LOG"
  die "mongo: not answering on 127.0.0.1:$MONGO_PORT after ${START_TIMEOUT}s (log: $MONGO_LOG)"
}

mongo_stop() { # [KILL]
  local pid i
  if pid=$(mongo_pid) && [[ ${1:-TERM} == TERM ]]; then
    log "mongo: stopping pid $pid"
    # CPython runs signal handlers on the main thread only, and a SIGTERM the kernel hands
    # to one of SecantusDB's worker threads does not wake the main thread: the first signal
    # can be lost. Its handler closes the listening socket first, so repeat the signal
    # until the port closes, then let it finish its WiredTiger shutdown.
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < STOP_TIMEOUT * 2; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      port_open "$MONGO_PORT" || break
      sleep 0.5
      kill -TERM "$pid" 2>/dev/null || true
    done
    wait_exit "$pid" "$STOP_TIMEOUT"
  fi
  stop_pid "$MONGO_PID" "--storage-path $MONGO_DATA" mongo KILL
}

# ---------------------------------------------------------------------------- MongoDB reaper

# mongod aborts a dead client's transaction after its lifetime from a background thread;
# SecantusDB only when a transaction statement arrives. The reaper sends one every few seconds
# (see stack/mongo_reaper.py), for everyone using the stack. The product never relies on it.
REAPER_PID=$RUN_DIR/mongo-reaper.pid

reaper_pid() { live_pid "$REAPER_PID" "$HERE/mongo_reaper.py $MONGO_URI"; }

reaper_start() {
  local pid
  if pid=$(reaper_pid); then
    log "mongo-reaper: already running (pid $pid)"
    return 0
  fi
  secantus_install
  TWOPHASE_MONGO_TXN_LIFETIME_S=$MONGO_TXN_LIFETIME_S TWOPHASE_MONGO_REAP_INTERVAL_S=$MONGO_REAP_INTERVAL_S \
    spawn "$REAPER_LOG" "$REAPER_PID" "$SECANTUS_VENV/bin/python" "$HERE/mongo_reaper.py" "$MONGO_URI"
  pid=$(head -n1 "$REAPER_PID")
  sleep 0.5
  kill -0 "$pid" 2>/dev/null || { show_log_tail "$REAPER_LOG"; die "mongo-reaper: exited during start-up (log: $REAPER_LOG)"; }
  log "mongo-reaper: up (pid $pid, every ${MONGO_REAP_INTERVAL_S}s, lifetime ${MONGO_TXN_LIFETIME_S}s, log $REAPER_LOG)"
}

reaper_stop() {
  stop_pid "$REAPER_PID" "$HERE/mongo_reaper.py $MONGO_URI" mongo-reaper TERM
}

# ---------------------------------------------------------------------------- schema registry

# Apicurio Registry, built once by Quarkus from Apicurio's Maven Central jars
# (registry/pom.xml): a runner jar plus lib/ in $REGISTRY_BUILD. In-memory storage (H2), so
# every start is empty; the Confluent-compatible API is under /apis/ccompat/v7.
REGISTRY_PID=$RUN_DIR/registry.pid
REGISTRY_JAR=$REGISTRY_BUILD/apicurio-registry-0-runner.jar
REGISTRY_CCOMPAT=/apis/ccompat/v7

# The stack dir in the command line tells this stack's registry from another stack's, which
# runs the same jar from the shared cache.
registry_pid() { live_pid "$REGISTRY_PID" "-Dtwophase.stack.dir=$STACK_DIR -jar $REGISTRY_JAR"; }

# Builds the registry unless $REGISTRY_BUILD holds this pom's build (stamp = pom's hash).
registry_build() {
  local stamp
  stamp="$REGISTRY_BUILD/.complete-$(sha "$HERE/registry/pom.xml")"
  [[ -f $stamp && -f $REGISTRY_JAR ]] && return 0
  need_mvn
  log "registry: building Apicurio Registry $REGISTRY_VERSION with Maven and Quarkus into $REGISTRY_BUILD (first run only)"
  local tmp="$REGISTRY_BUILD.tmp.$$"
  rm -rf "$tmp"
  local mvn_log=$LOG_DIR/maven-registry.log
  mkdir -p "$LOG_DIR" "$(dirname "$REGISTRY_BUILD")"
  if ! mvn -B -Dstyle.color=never -f "$HERE/registry/pom.xml" -Dmaven.repo.local="$M2" \
      -Dtwophase.registry.build.dir="$tmp/target" package >"$mvn_log" 2>&1; then
    rm -rf "$tmp"
    grep -E '^\[ERROR\]' "$mvn_log" | head -n 5 >&2 || true
    die "Maven could not build the registry from $HERE/registry/pom.xml (full output: $mvn_log)"
  fi
  # Keep what runs (the legacy-jar layout: runner + lib/), not Maven's work files.
  mv "$tmp/target/apicurio-registry-0-runner.jar" "$tmp/target/lib" "$tmp/" ||
    die "registry: the build left no runner jar in $tmp/target (log: $mvn_log)"
  rm -rf "$tmp/target" "$REGISTRY_BUILD"
  mv "$tmp" "$REGISTRY_BUILD"
  touch "$stamp"
}

# HTTP status of GET $1 on the registry, with bash alone (no curl on a bare machine).
registry_http_status() {
  # A subshell: a failed redirection of exec must not end the script.
  (
    exec 4<>"/dev/tcp/127.0.0.1/$REGISTRY_PORT" || exit 1
    printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$1" >&4
    IFS=' ' read -r -t 5 _ status _ <&4 || exit 1
    printf '%s\n' "$status"
  )
}

registry_start() {
  local pid
  if pid=$(registry_pid); then
    log "registry: already running (pid $pid)"
    return 0
  fi
  need_java
  registry_build
  require_port_free "$REGISTRY_PORT" "the schema registry (TWOPHASE_REGISTRY_PORT)"
  touch "$REGISTRY_LOG"
  # quarkus.http.* are runtime settings, so the one build serves every port. The H2 URL is
  # the build's default, spelled out: in memory, gone when the process ends.
  spawn "$REGISTRY_LOG" "$REGISTRY_PID" java -Xms64m -Xmx"$REGISTRY_HEAP" \
    -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true \
    -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$REGISTRY_PORT" \
    -Dquarkus.datasource.jdbc.url=jdbc:h2:mem:registry_db \
    -Dtwophase.stack.dir="$STACK_DIR" -jar "$REGISTRY_JAR"
  pid=$(head -n1 "$REGISTRY_PID")
  local i
  for ((i = 0; i < START_TIMEOUT * 5; i++)); do
    kill -0 "$pid" 2>/dev/null || { show_log_tail "$REGISTRY_LOG"; die "registry: exited during start-up (log: $REGISTRY_LOG)"; }
    # Ready when the Confluent-compatible API itself answers, not just the port.
    if [[ $(registry_http_status "$REGISTRY_CCOMPAT/subjects" 2>/dev/null) == 200 ]]; then
      log "registry: up on 127.0.0.1:$REGISTRY_PORT (pid $pid, log $REGISTRY_LOG)"
      return 0
    fi
    sleep 0.2
  done
  show_log_tail "$REGISTRY_LOG"
  die "registry: $REGISTRY_CCOMPAT not answering on 127.0.0.1:$REGISTRY_PORT after ${START_TIMEOUT}s (log: $REGISTRY_LOG)"
}

registry_stop() { # [KILL]
  stop_pid "$REGISTRY_PID" "-Dtwophase.stack.dir=$STACK_DIR -jar $REGISTRY_JAR" registry "${1:-TERM}"
}

# ---------------------------------------------------------------------------- MinIO

# S3 for s3:// warehouses (the iceberg sink): a MinIO server that stack/minio.sh builds from
# the Go module proxy. AGPLv3: run unmodified as a separate test service, never linked into or
# shipped with twophase. One drive, one bucket made at start; data kept across restarts.
MINIO_VERSION=$(sed -n 's/^MINIO_VERSION="\([^"]*\)".*/\1/p' "$HERE/minio.sh" | head -n1)
MINIO_PORT=${TWOPHASE_MINIO_PORT:-9000}
MINIO_DIR=$STACK_DIR/minio
MINIO_DATA=$MINIO_DIR/data
MINIO_BIN=$CACHE_DIR/minio/$MINIO_VERSION/minio
MINIO_PID=$RUN_DIR/minio.pid
MINIO_LOG=$LOG_DIR/minio.log
MINIO_URL=http://127.0.0.1:$MINIO_PORT
# Fixed: a test service on 127.0.0.1 only. MinIO wants a secret of 8 characters or more.
MINIO_ACCESS_KEY=twophase
MINIO_SECRET_KEY=twophase-secret
MINIO_BUCKET=warehouse
MINIO_REGION=us-east-1

[[ -n $MINIO_VERSION ]] || die "could not read MINIO_VERSION=\"...\" from $HERE/minio.sh"

minio_pid() { live_pid "$MINIO_PID" "$MINIO_DATA"; }

need_curl() {
  command -v curl >/dev/null 2>&1 || die "curl not found: the stack makes MinIO's bucket with it (Debian: apt-get install curl)"
}

# stack/minio.sh is idempotent (it checks the binary's version); its output goes to a log
# because a cold build prints hundreds of "go: downloading" lines.
minio_build() {
  local build_log=$LOG_DIR/minio-build.log
  mkdir -p "$LOG_DIR"
  [[ -x $MINIO_BIN ]] ||
    log "minio: building MinIO $MINIO_VERSION from the Go module proxy into $(dirname "$MINIO_BIN") (first run only, 6-11 min on 2 cores; output: $build_log)"
  if ! TWOPHASE_CACHE_DIR=$CACHE_DIR bash "$HERE/minio.sh" >"$build_log" 2>&1; then
    tail -n 20 "$build_log" >&2 || true
    die "minio: stack/minio.sh could not build MinIO $MINIO_VERSION (full output: $build_log)"
  fi
}

minio_ready() {
  curl -fsS -o /dev/null --max-time 2 "$MINIO_URL/minio/health/ready" 2>/dev/null
}

# PUT Bucket, signed with curl's SigV4: no S3 client needed at stack-up time.
minio_make_bucket() {
  local out status
  out=$(curl -sS --max-time 10 -w '\n%{http_code}' -X PUT --aws-sigv4 "aws:amz:$MINIO_REGION:s3" \
    --user "$MINIO_ACCESS_KEY:$MINIO_SECRET_KEY" "$MINIO_URL/$MINIO_BUCKET") ||
    die "minio: PUT $MINIO_URL/$MINIO_BUCKET failed (curl >= 7.75 is needed for --aws-sigv4)"
  status=${out##*$'\n'}
  case $status in
    200) log "minio: made bucket $MINIO_BUCKET" ;;
    409) [[ $out == *BucketAlreadyOwnedByYou* ]] || die "minio: PUT /$MINIO_BUCKET answered 409: ${out%$'\n'*}" ;;
    *) die "minio: PUT /$MINIO_BUCKET answered HTTP $status: ${out%$'\n'*}" ;;
  esac
}

minio_start() {
  local pid
  if pid=$(minio_pid); then
    log "minio: already running (pid $pid)"
    return 0
  fi
  need_curl
  minio_build
  require_port_free "$MINIO_PORT" "MinIO (TWOPHASE_MINIO_PORT)"
  mkdir -p "$MINIO_DATA"
  touch "$MINIO_LOG"
  # MINIO_BROWSER=off: no console, so no second port. HOME: MinIO makes ~/.minio (its old
  # config dir, made even when --certs-dir points elsewhere); this keeps it in the stack dir.
  # MINIO_UPDATE=off: it never replaces its own binary. The region is what clients sign with.
  HOME=$MINIO_DIR MINIO_ROOT_USER=$MINIO_ACCESS_KEY MINIO_ROOT_PASSWORD=$MINIO_SECRET_KEY \
    MINIO_SITE_REGION=$MINIO_REGION MINIO_BROWSER=off MINIO_UPDATE=off \
    spawn "$MINIO_LOG" "$MINIO_PID" "$MINIO_BIN" server --address "127.0.0.1:$MINIO_PORT" "$MINIO_DATA"
  pid=$(head -n1 "$MINIO_PID")
  local i
  for ((i = 0; i < START_TIMEOUT * 5; i++)); do
    kill -0 "$pid" 2>/dev/null || { show_log_tail "$MINIO_LOG"; die "minio: exited during start-up (log: $MINIO_LOG)"; }
    if minio_ready; then
      minio_make_bucket
      log "minio: up on 127.0.0.1:$MINIO_PORT (pid $pid, bucket $MINIO_BUCKET, log $MINIO_LOG)"
      return 0
    fi
    sleep 0.2
  done
  show_log_tail "$MINIO_LOG"
  die "minio: not ready on 127.0.0.1:$MINIO_PORT after ${START_TIMEOUT}s (log: $MINIO_LOG)"
}

minio_stop() { # [KILL]
  stop_pid "$MINIO_PID" "$MINIO_DATA" minio "${1:-TERM}"
}

# ---------------------------------------------------------------------------- Spark

spark_jars() {
  fetch_jars "$HERE/spark-kafka/pom.xml" "$SPARK_JARS_DIR" -Dspark.version="$SPARK_VERSION"
  # Iceberg's Spark runtime and the PostgreSQL driver of its JdbcCatalog: Spark reads the
  # iceberg sink's tables (docs/spark.md). Versions and why: stack/spark-iceberg/pom.xml.
  fetch_jars "$HERE/spark-iceberg/pom.xml" "$CACHE_DIR/jars/spark-iceberg"
}

spark_jar_list() {
  local jars=("$SPARK_JARS_DIR"/*.jar "$CACHE_DIR/jars/spark-iceberg"/*.jar)
  local IFS=,
  printf '%s' "${jars[*]}"
}

# ---------------------------------------------------------------------------- env file

env_lines() {
  cat <<EOF
TWOPHASE_STACK_DIR='$STACK_DIR'
TWOPHASE_CACHE_DIR='$CACHE_DIR'
TWOPHASE_KAFKA_BOOTSTRAP='$(kafka_bootstrap)'
TWOPHASE_KAFKA_VERSION='$KAFKA_VERSION'
TWOPHASE_KAFKA_JARS_DIR='$KAFKA_JARS'
TWOPHASE_KAFKA_LOG='$(kafka_node 1 && printf '%s' "$NODE_LOG")'
TWOPHASE_PG_DSN='$PG_DSN'
TWOPHASE_PG_BIN='$PG_BIN'
TWOPHASE_PG_LOG='$PG_LOG'
TWOPHASE_MONGO_URI='$MONGO_URI'
TWOPHASE_MONGO_LOG='$MONGO_LOG'
TWOPHASE_MONGO_REAPER_LOG='$REAPER_LOG'
TWOPHASE_MONGO_TXN_LIFETIME_S='$MONGO_TXN_LIFETIME_S'
TWOPHASE_SECANTUS_VERSION='$SECANTUS_VERSION'
TWOPHASE_SPARK_VERSION='$SPARK_VERSION'
TWOPHASE_SPARK_JARS='$(spark_jar_list)'
TWOPHASE_SCHEMA_REGISTRY_URL='http://127.0.0.1:$REGISTRY_PORT$REGISTRY_CCOMPAT'
TWOPHASE_REGISTRY_VERSION='$REGISTRY_VERSION'
TWOPHASE_REGISTRY_LOG='$REGISTRY_LOG'
TWOPHASE_S3_ENDPOINT='$MINIO_URL'
TWOPHASE_S3_ACCESS_KEY='$MINIO_ACCESS_KEY'
TWOPHASE_S3_SECRET_KEY='$MINIO_SECRET_KEY'
TWOPHASE_S3_BUCKET='$MINIO_BUCKET'
TWOPHASE_S3_REGION='$MINIO_REGION'
TWOPHASE_MINIO_VERSION='$MINIO_VERSION'
TWOPHASE_MINIO_LOG='$MINIO_LOG'
EOF
  # Only when set, so the default stack's file stays as it was.
  if ((KAFKA_BROKERS > 1)); then
    local n nodes=''
    for ((n = 1; n <= KAFKA_BROKERS; n++)); do
      kafka_node "$n"
      nodes+="${nodes:+,}$n=127.0.0.1:$NODE_PORT"
    done
    # Node id = address; node N's log is logs/kafka-N.log (TWOPHASE_KAFKA_LOG is node 1's).
    printf "TWOPHASE_KAFKA_BROKERS='%s'\nTWOPHASE_KAFKA_NODES='%s'\n" "$KAFKA_BROKERS" "$nodes"
  fi
  if [[ -n ${TWOPHASE_KAFKA_EXTRA_LISTENERS:-} ]]; then
    printf "TWOPHASE_KAFKA_EXTRA_LISTENERS='%s'\n" "$TWOPHASE_KAFKA_EXTRA_LISTENERS"
  fi
}

write_env() {
  find_pg || true
  local tmp=$STACK_DIR/stack.env.tmp
  {
    echo "# Written by stack/stack.sh up: where the local stack listens. Sourceable."
    env_lines
  } >"$tmp"
  mv "$tmp" "$STACK_DIR/stack.env"
}

# ---------------------------------------------------------------------------- commands

# One stack.sh at a time per stack dir: two `make test` runs in the same checkout must not
# both format Kafka or both fill the Maven cache.
lock() {
  mkdir -p "$STACK_DIR" "$RUN_DIR" "$LOG_DIR" "$CACHE_DIR"
  exec 9>"$STACK_DIR/.lock"
  if ! flock -n 9; then
    log "another stack.sh is running on $STACK_DIR; waiting for it"
    flock 9
  fi
}

cmd_up() {
  lock
  local t0=$SECONDS
  # Fetch everything first, so a registry failure stops us before anything is started.
  need_java
  # Ports first: a clash found after Kafka started would leave a half-up stack.
  kafka_parse_extra_listeners
  kafka_check_layout
  local n
  for ((n = 1; n <= KAFKA_BROKERS; n++)); do
    kafka_node "$n"
    kafka_node_pid >/dev/null || kafka_require_ports "$n"
  done
  pg_pid >/dev/null || require_port_free "$PG_PORT" "PostgreSQL (TWOPHASE_PG_PORT)"
  mongo_pid >/dev/null || require_port_free "$MONGO_PORT" "SecantusDB (TWOPHASE_MONGO_PORT)"
  registry_pid >/dev/null || require_port_free "$REGISTRY_PORT" "the schema registry (TWOPHASE_REGISTRY_PORT)"
  minio_pid >/dev/null || require_port_free "$MINIO_PORT" "MinIO (TWOPHASE_MINIO_PORT)"
  need_curl
  kafka_jars
  spark_jars
  registry_build
  minio_build
  secantus_install
  pg_install
  kafka_start
  pg_start
  mongo_start
  reaper_start
  registry_start
  minio_start
  write_env
  # Optional services (stack/README.md): off by default so plain `make stack-up` stays fast.
  if [[ ${TWOPHASE_STACK_CONNECT:-0} == 1 ]]; then
    bash "$HERE/connect.sh" up
  fi
  log "stack up in $((SECONDS - t0))s; settings in $STACK_DIR/stack.env"
  cmd_status
}

cmd_down() {
  lock
  # Before Kafka: a worker that loses its broker retries noisily until it is stopped.
  bash "$HERE/connect.sh" down
  registry_stop TERM
  minio_stop TERM
  reaper_stop
  mongo_stop TERM
  kafka_stop TERM
  pg_stop TERM
  rm -f "$STACK_DIR/stack.env"
  log "stack down (data kept in $STACK_DIR; delete it for a fresh start)"
}

status_line() { # name pid port log
  if [[ -n $2 ]]; then
    printf '%-9s up    pid %-8s 127.0.0.1:%-6s log %s\n' "$1" "$2" "$3" "$4"
  else
    printf '%-9s down  %-12s 127.0.0.1:%-6s log %s\n' "$1" "" "$3" "$4"
  fi
}

cmd_status() {
  local n
  for ((n = 1; n <= KAFKA_BROKERS; n++)); do
    kafka_node "$n"
    status_line "$NODE_NAME" "$(kafka_node_pid || true)" "$NODE_PORT" "$NODE_LOG"
  done
  status_line postgres "$(pg_pid || true)" "$PG_PORT" "$PG_LOG"
  status_line mongo "$(mongo_pid || true)" "$MONGO_PORT" "$MONGO_LOG"
  status_line registry "$(registry_pid || true)" "$REGISTRY_PORT" "$REGISTRY_LOG"
  status_line minio "$(minio_pid || true)" "$MINIO_PORT" "$MINIO_LOG"
  bash "$HERE/connect.sh" status
  local rp
  if rp=$(reaper_pid); then
    printf '%-9s up    pid %-8s %-16s log %s\n' reaper "$rp" "lifetime ${MONGO_TXN_LIFETIME_S}s" "$REAPER_LOG"
  else
    printf '%-9s down  %-12s %-16s log %s\n' reaper "" "" "$REAPER_LOG"
  fi
  if [[ -f $STACK_DIR/stack.env ]]; then
    echo "--- $STACK_DIR/stack.env"
    grep -v '^#' "$STACK_DIR/stack.env"
  else
    echo "--- no $STACK_DIR/stack.env: run \`make stack-up\`"
  fi
}

restart() { # service [--kill]
  local signal=TERM
  case "${2:-}" in
    "") ;;
    --kill) signal=KILL ;;
    *) die "usage: stack.sh restart-$1 [--kill]" ;;
  esac
  lock
  "$1_stop" "$signal"
  "$1_start"
  write_env
}

# Starts only the services named (a test's private Kafka, say); writes stack.env as up does.
cmd_start() { # service...
  local s services="kafka pg mongo registry minio"
  (($# > 0)) || die "usage: stack.sh start SERVICE... ($services)"
  for s in "$@"; do
    [[ " $services " == *" $s "* ]] || die "stack.sh start: unknown service '$s' (one of: $services)"
  done
  lock
  for s in "$@"; do
    "${s}_start"
    if [[ $s == mongo ]]; then reaper_start; fi
  done
  write_env
}

# One Kafka node: kill-broker N | stop-broker N [--kill] | start-broker N | restart-broker N [--kill].
broker_cmd() { # stop|start|restart command node [--kill]
  local signal=TERM
  [[ ${3:-} =~ ^[1-9]$ ]] && (($3 <= KAFKA_BROKERS)) ||
    die "usage: stack.sh $2 N, N = 1..$KAFKA_BROKERS (TWOPHASE_KAFKA_BROKERS=$KAFKA_BROKERS)"
  case "${4:-}" in
    "") ;;
    --kill) signal=KILL ;;
    *) die "usage: stack.sh $2 N [--kill]" ;;
  esac
  set -- "$1" "$3"
  lock
  kafka_check_layout
  if [[ $1 != start ]]; then kafka_stop "$signal" "$2"; fi
  if [[ $1 != stop ]]; then kafka_start "$2"; fi
}

main() {
  case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    restart-kafka) restart kafka "${2:-}" ;;
    restart-pg) restart pg "${2:-}" ;;
    restart-mongo) restart mongo "${2:-}" ;;
    restart-minio) restart minio "${2:-}" ;;
    start) shift; cmd_start "$@" ;;
    kill-broker) broker_cmd stop "$1" "${2:-}" --kill ;;
    stop-broker | restart-broker) broker_cmd "${1%-broker}" "$1" "${2:-}" "${3:-}" ;;
    start-broker) broker_cmd start "$1" "${2:-}" ;;
    kafka-run)
      shift
      [[ $# -ge 1 ]] || die "usage: stack.sh kafka-run CLASS [ARGS...]"
      need_java
      kafka_jars
      kafka_java "$@"
      ;;
    *)
      sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
      exit 2
      ;;
  esac
}

# Sourced (by stack/connect.sh, for the helpers and pins above): run no command.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
fi
