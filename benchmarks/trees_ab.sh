#!/bin/bash
# Paired, interleaved A/B of two ember checkouts serving SmolLM2 on one box: both servers
# up at once, each load sent to one and then the other, the order swapped round by round.
#   benchmarks/trees_ab.sh OLD_CHECKOUT NEW_CHECKOUT [ROUNDS] [LOADS]   (results in /tmp/ab)
# LOADS: names from benchmarks/loads.sh (default: agentic). Run from a checkout whose
# .venv is installed (`make install`); OLD is e.g. a worktree of the commit before a
# change (`git worktree add ../old COMMIT`); each checkout builds its own kernels.
# $AB_ARGS: flags for both servers.
set -u
OLD_DIR=$(realpath "$1") NEW_DIR=$(realpath "$2") ROUNDS=${3:-5} NAMES=${4:-agentic}
PY=$PWD/.venv/bin/python
mkdir -p /tmp/ab
source benchmarks/loads.sh
serve() {  # DIR PORT LOG
  (cd "$1" && PYTHONPATH=$1 EMBER_LOG_LEVEL=WARNING exec $PY -m ember.cli serve --port "$2" \
      --kv-cache-memory 1G ${AB_ARGS:-} > "$3" 2>&1) &
}
serve "$OLD_DIR" 8201 /tmp/ab/old.log; OLD=$!
serve "$NEW_DIR" 8202 /tmp/ab/new.log; NEW=$!
trap 'kill $OLD $NEW 2>/dev/null; wait' EXIT  # (exec: these are the servers themselves)
for port in 8201 8202; do until curl -sf http://127.0.0.1:$port/health >/dev/null; do sleep 1; done; done
for round in $(seq "$ROUNDS"); do
  for name in $NAMES; do
    sides="old new"; [ $((round % 2)) = 0 ] && sides="new old"
    for side in $sides; do
      port=$([ $side = old ] && echo 8201 || echo 8202)
      out=/tmp/ab/$name-$round-$side
      (cd "$NEW_DIR" && $PY -m ember.cli bench serve --url http://127.0.0.1:$port ${LOADS[$name]} \
          --seed "$round" --no-progress --out "$out.json" > "$out.txt" 2>&1)
      echo "$round $name $side $(grep -E '^(throughput|TTFT|ITL)' "$out.txt" | tr '\n' ' ')"
    done
  done
done
