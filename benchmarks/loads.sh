# The loads that benchmarks/peer_ab.sh, cgroup_ab.sh and fresh_server.sh send, by name:
# `ember bench serve` flags in LOADS. Sourced from the repository's root; TRACE is the
# Mooncake conversation trace beside it.
TRACE=$(realpath ../shared/traces/mooncake-conversation_trace.jsonl)
declare -A LOADS=(
  [random]="--workload random --num-requests 16 --max-concurrency 4 --input-len 286 --output-len 64"
  [agentic]="--workload agentic --num-sessions 4 --num-turns 4 --system-tokens 512 --num-tools 4 --tool-tokens 32 --turn-tokens 48 --output-len 32 --max-concurrency 4"
  [agentic-notools]="--workload agentic --num-sessions 4 --num-turns 4 --system-tokens 512 --num-tools 0 --turn-tokens 48 --output-len 32 --max-concurrency 4"
  [trace]="--workload trace --trace $TRACE --num-requests 40 --trace-block-tokens 16 --time-scale 0 --max-concurrency 8"
  [random32]="--workload random --num-requests 96 --max-concurrency 32 --input-len 128 --output-len 64"
)
