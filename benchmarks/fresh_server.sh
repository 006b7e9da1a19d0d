#!/bin/bash
# One load against a freshly started server: how many of its steps the step budget capped
# (its DEBUG step log) and the load's numbers. TREE: an ember checkout (a worktree of
# another commit, or this one); WORKLOAD: a load of benchmarks/loads.sh (random32, trace).
#
#   benchmarks/fresh_server.sh TREE WORKLOAD
set -u
TREE=$(realpath "$1") W=$2
PY=$PWD/.venv/bin/python
source benchmarks/loads.sh
(cd "$TREE" && EMBER_LOG_LEVEL=DEBUG PYTHONPATH=$TREE exec $PY -m ember.cli serve --port 8500 \
    --kv-cache-memory 1G --max-model-len 4096 ${EMBER_ARGS:---matmul-precision bf16} > /tmp/fresh-server.log 2>&1) &
S=$!
trap 'kill $S 2>/dev/null; wait' EXIT
for _ in $(seq 300); do curl -sf http://127.0.0.1:8500/health >/dev/null && break; sleep 1; done
sleep 3  # the idle work: the KV pool's pages, then (since calibration) the cost model's
$PY -m ember.cli bench serve --url http://127.0.0.1:8500 ${LOADS[$W]} \
    --tokenizer "${TOKENIZER:-/work/bench/smollm2-hf}" --seed 1 --no-progress > /tmp/fresh-server.txt 2>&1
steps=$(grep -c 'step:' /tmp/fresh-server.log)
capped=$(grep 'step:' /tmp/fresh-server.log | grep -vc 'cap None')
echo "$(basename "$TREE") $W: capped $capped of $steps steps; $(grep -E '^(throughput|TTFT|ITL)' /tmp/fresh-server.txt | tr '\n' ' ')"
grep -m1 "calibrated" /tmp/fresh-server.log | cut -c1-200
