#!/bin/bash
# Agent sessions whose live contexts need several times the engines' KV pools: ember with
# the tiers off, ember with them on (host memory + a shared Mooncake Store), and vLLM's
# CPU build (prefix cache only), paired and interleaved (all servers up at once, each
# round sent to one after another, the order alternating), 2 ember workers behind the
# router, vLLM one server on the same cores with the same pool in tokens.
#
#   benchmarks/kv_tiers_ab.sh VLLM_PYTHON HF_DIR [ROUNDS]
#
# Runs itself inside a loopback-only network namespace (Mooncake listens on every
# interface). $SIDES (default "off on vllm"; also on-finished, on-computed, on-evicted:
# the tiers with that --kv-save, "on" with the default), $POOL (per ember
# worker, default 80M: ~1800 fp32 tokens of SmolLM2), $VLLM_BLOCKS (default 114 blocks
# of 32: the two ember pools' tokens), $SESSIONS (32), $TURNS (6), $THINK (1 s), $SYSTEM
# (512-token system prompt), $SHARING (per-session: each session its own system prompt;
# shared: one for all), $CONTEXT (0: tokens of each session's own context in its first
# message).
# Results: /tmp/tiers/<round>-<side>.json and .txt, one line per run.
set -u
if [ -z "${EMBER_NETNS:-}" ]; then
  exec unshare -rn bash -c "ip link set lo up && EMBER_NETNS=1 exec bash $0 $*"
fi
VLLM_PY=$1 HF_DIR=$(realpath "$2") ROUNDS=${3:-2}
SIDES=${SIDES:-off on vllm} POOL=${POOL:-80M} VLLM_BLOCKS=${VLLM_BLOCKS:-114}
PY=$PWD/.venv/bin/python
OUT=/tmp/tiers
mkdir -p $OUT
export EMBER_LOG_LEVEL=WARNING MC_LOG_LEVEL=ERROR
COMMON="--pin --kv-cache-memory $POOL --max-model-len 1536 --matmul-precision bf16"
TIERS="--kv-offload-memory 512M --kv-store mooncake --kv-store-memory 3G"
declare -A PORT=([off]=8300 [on]=8400 [on-finished]=8700 [on-computed]=8500
                 [on-evicted]=8600 [vllm]=8101)
declare -A EXTRA=([off]="" [on]="$TIERS" [on-finished]="$TIERS --kv-save finished"
                  [on-computed]="$TIERS --kv-save computed" [on-evicted]="$TIERS --kv-save evicted")
PIDS=""
for side in $SIDES; do
  port=${PORT[$side]}
  if [ "$side" = vllm ]; then
    (VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=1 exec "$VLLM_PY" \
        -m vllm.entrypoints.openai.api_server --model "$HF_DIR" --served-model-name smollm2 \
        --dtype bfloat16 --max-model-len 1536 --block-size 32 --enable-prompt-tokens-details \
        --num-gpu-blocks-override "$VLLM_BLOCKS" --enable-prefix-caching \
        --enable-auto-tool-choice --tool-call-parser hermes \
        --port $port --host 127.0.0.1 > $OUT/vllm.log 2>&1) &
  else
    $PY -m ember.cli up "$HF_DIR" --mixed 2 --port $port --worker-port $((port + 10)) \
        $COMMON ${EXTRA[$side]} > $OUT/$side.log 2>&1 &
  fi
  PIDS="$PIDS $!"
done
trap 'kill $PIDS 2>/dev/null; wait' EXIT
for side in $SIDES; do
  for _ in $(seq 900); do
    curl -sf http://127.0.0.1:${PORT[$side]}/health >/dev/null && break
    sleep 1
  done
done
ARGS="--workload agentic --num-sessions ${SESSIONS:-32} --num-turns ${TURNS:-6}
      --system-tokens ${SYSTEM:-512} --num-tools 0 --turn-tokens 64 --output-len 32
      --prefix-sharing ${SHARING:-per-session} --session-context-tokens ${CONTEXT:-0}
      --think-time ${THINK:-1} --max-concurrency 4"
for round in $(seq "$ROUNDS"); do
  # the order reverses every other round
  sides=$([ $((round % 2)) = 1 ] && echo $SIDES || echo $SIDES | tr ' ' '\n' | tac | tr '\n' ' ')
  for side in $sides; do
    out=$OUT/$round-$side
    $PY -m ember.cli bench serve --url http://127.0.0.1:${PORT[$side]} $ARGS \
        --tokenizer "$HF_DIR" --seed "$round" --no-progress --out "$out.json" > "$out.txt" 2>&1
    echo "$round $side $(grep -E '^(requests|cache hit|TTFT)' "$out.txt" | tr '\n' ' ')"
    if [ "$side" != vllm ]; then  # the tiers' counters, per worker
      for w in 0 1; do
        curl -s http://127.0.0.1:$((${PORT[$side]} + 10 + w))/load > "$out.worker$w.json"
      done
    fi
  done
done
