#!/bin/bash
# Batch-1 decode, ember (fp32 and int8 activations) against llama.cpp's llama-bench on the
# same GGUF files, alternating, ROUNDS times (2 threads each).
#
#   benchmarks/llamacpp_b1.sh LLAMA_BENCH ROUNDS FILE...
#
# LLAMA_BENCH: llama.cpp's llama-bench (e.g. built from the llama-cpp-python sdist's
# vendor/llama.cpp: cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build
# --target llama-bench llama-quantize; llama-quantize --allow-requantize makes the K-quant
# files from the default Q4_1 one).
set -u
LB=$1 ROUNDS=$2
shift 2
PY=$PWD/.venv/bin/python
for round in $(seq "$ROUNDS"); do
  for file in "$@"; do
    name=$(basename "$file")
    for activations in fp32 int8; do
      rate=$($PY -m ember.cli bench offline "$file" --num-prompts 1 --prompt-len 32 \
          --output-len 128 --skip-throughput --repeats 3 --threads 2 \
          --decode-activations $activations 2>&1 | grep 'batch-1 decode (tokens' | awk '{print $NF}')
      echo "$round $name ember-$activations $rate"
    done
    rate=$("$LB" -m "$file" -p 0 -n 128 -t 2 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $8}')
    echo "$round $name llama.cpp $rate"
  done
done
