#!/usr/bin/env bash
# Whole starts of `ember serve` on two (or more) trees of this repository, one start of
# each in turn, so that both meet the same load on a noisy box: for each round and tree,
# `ember bench startup --warm --repeats 1` with that tree first on PYTHONPATH (its own
# kernels build once, on first use), then the line of medians, the core's imports phase
# (when it ended, its CPU seconds) and when the core was ready.
#
#   git worktree add /tmp/before <commit>
#   benchmarks/startup_trees.sh ROUNDS /tmp/before "$PWD"
set -euo pipefail
rounds=$1
shift
python=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
for _ in $(seq "$rounds"); do
  for tree in "$@"; do
    out=$(cd /tmp && PYTHONPATH=$tree "$python" -m ember.cli bench startup --warm --repeats 1 2>&1)
    imports=$(echo "$out" | awk '$1 == "core" && $2 == "imports" {print $3, $5}')
    ready=$(echo "$out" | awk '$1 == "core" && $2 == "ready" {print $3}')
    echo "$tree $(echo "$out" | grep '^median') | core imports at, cpu: $imports | core ready: $ready"
  done
done
