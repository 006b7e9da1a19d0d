#!/bin/bash
# Two ember servers at once, each in its own v1 cpu cgroup of CPUS CPUs (as root, where
# /sys/fs/cgroup/cpu is writable): OLD_TREE (a worktree of an earlier commit, port 8401)
# and this tree (port 8402); a load of benchmarks/loads.sh sent to one then the other,
# ROUNDS times. Prints one line per run and each cgroup's throttled time.
#
#   benchmarks/cgroup_ab.sh OLD_TREE [ROUNDS] [random|agentic-notools] [CPUS]
set -u
OLD=$(realpath "$1") NEW=$PWD ROUNDS=${2:-2} W=${3:-random} CPUS=${4:-1}
PY=$NEW/.venv/bin/python
for g in ember-ab-old ember-ab-new; do
  mkdir -p /sys/fs/cgroup/cpu/$g
  period=$(cat /sys/fs/cgroup/cpu/$g/cpu.cfs_period_us)
  echo $(( period * CPUS )) > /sys/fs/cgroup/cpu/$g/cpu.cfs_quota_us
done
start() { # tree cgroup port
  (cd "$1" && echo $BASHPID > /sys/fs/cgroup/cpu/$2/cgroup.procs && EMBER_LOG_LEVEL=WARNING \
    PYTHONPATH=$1 exec $PY -m ember.cli serve --port $3 --kv-cache-memory 1G \
    --max-model-len 4096 ${EMBER_ARGS:-} > /tmp/cgroup-ab-$3.log 2>&1) &
}
start "$OLD" ember-ab-old 8401; A=$!
start "$NEW" ember-ab-new 8402; B=$!
trap 'kill $A $B 2>/dev/null; wait; rmdir /sys/fs/cgroup/cpu/ember-ab-old /sys/fs/cgroup/cpu/ember-ab-new' EXIT
for port in 8401 8402; do
  for _ in $(seq 300); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
done
source benchmarks/loads.sh
for round in $(seq "$ROUNDS"); do
  for port in 8401 8402; do
    name=$([ $port = 8401 ] && echo old || echo new)
    $PY -m ember.cli bench serve --url http://127.0.0.1:$port ${LOADS[$W]} \
        --tokenizer "${TOKENIZER:-/work/bench/smollm2-hf}" --seed "$round" --no-progress > /tmp/cgroup-ab.txt 2>&1
    echo "$round $W $name $(grep -E '^(throughput|TTFT|ITL)' /tmp/cgroup-ab.txt | tr '\n' ' ')"
  done
done
for g in ember-ab-old ember-ab-new; do echo "$g $(grep throttled_time /sys/fs/cgroup/cpu/$g/cpu.stat)"; done
