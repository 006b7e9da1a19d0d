#!/bin/bash
# Speculative decoding against none, on one box, paired and interleaved: two ember
# servers up at once (drafts off, and $SPEC_ARGS), each workload sent to one and then the
# other, ROUNDS times, the order swapped every round.
#
#   benchmarks/spec_ab.sh [ROUNDS] [WORKLOADS]
#
# WORKLOADS (default: all four): quote-b1 quote-c4 (agentic sessions whose replies quote
# their context: each message asks for 64 tokens of the session's 384-token context back
# verbatim), chat-b1 chat-c4 (agentic sessions of plain chat); b1: one request at a time,
# c4: 4 at once. Greedy; replies end where the model ends them (at most 128 tokens).
# $MODEL (default smollm2-135m), $SPEC_ARGS (default --speculative-method ngram), and
# $EMBER_ARGS for both servers. Results: /tmp/spec/<workload>-<round>-<side>.json, one line
# per run, and whether the two sides' replies were the same.
set -u
ROUNDS=${1:-2} WORKLOADS=${2:-quote-b1 quote-c4 chat-b1 chat-c4}
PY=$PWD/.venv/bin/python
MODEL=${MODEL:-smollm2-135m}
mkdir -p /tmp/spec
serve() {  # port, extra args
  EMBER_LOG_LEVEL=WARNING $PY -m ember.cli serve "$MODEL" --port "$1" --kv-cache-memory 1G \
      --max-model-len 4096 ${EMBER_ARGS:-} "${@:2}" > "/tmp/spec/server-$1.log" 2>&1 &
}
serve 8300
OFF=$!
# shellcheck disable=SC2086
serve 8301 ${SPEC_ARGS:---speculative-method ngram}
ON=$!
trap 'kill $OFF $ON 2>/dev/null; wait' EXIT
for port in 8300 8301; do
  for _ in $(seq 600); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
done
SESSIONS="--workload agentic --num-sessions 4 --num-turns 3 --system-tokens 256 --num-tools 0 --turn-tokens 32 --output-len 128 --no-ignore-eos"
declare -A ARGS=(
  [quote-b1]="$SESSIONS --session-context-tokens 384 --quote-tokens 64 --max-concurrency 1"
  [quote-c4]="$SESSIONS --session-context-tokens 384 --quote-tokens 64 --max-concurrency 4"
  [chat-b1]="$SESSIONS --max-concurrency 1"
  [chat-c4]="$SESSIONS --max-concurrency 4"
)
for round in $(seq "$ROUNDS"); do
  for workload in $WORKLOADS; do
    sides=$([ $((round % 2)) = 1 ] && echo "off on" || echo "on off")
    for side in $sides; do
      port=$([ "$side" = off ] && echo 8300 || echo 8301)
      out=/tmp/spec/$workload-$round-$side
      $PY -m ember.cli bench serve --url http://127.0.0.1:$port ${ARGS[$workload]} \
          --seed "$round" --no-progress --out "$out.json" > "$out.txt" 2>&1
      echo "$round $workload $side $(grep -E '^(throughput|TPOT|speculative)' "$out.txt" | tr '\n' ' ')"
    done
    $PY - "/tmp/spec/$workload-$round" <<'PYEOF'
import json, sys
runs = [json.load(open(f"{sys.argv[1]}-{side}.json"))["requests"] for side in ("off", "on")]
key = lambda r: (r["session_id"], r["turn"])
digests = [{key(r): r["reply_digest"] for r in run} for run in runs]
same = sum(digests[0][k] == digests[1].get(k) for k in digests[0])
print(f"  same replies: {same} of {len(digests[0])}")
PYEOF
  done
done
