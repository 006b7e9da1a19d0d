// bf16 activations that a oneDNN matmul reads next, over storage for their rows rounded up
// to kRowQuantum. oneDNN makes (JIT-compiles) a primitive for each row count it sees and
// keeps the last 1,024; a prefill step's row count is its prompt tokens plus its decode
// rows, so steps kept paying 7-12 ms for new counts, and the cache grew toward a gigabyte.
// ember.models.layers.Linear runs the matmul over the rounded rows where the storage has
// them (docs/benchmarks.md, "oneDNN makes a primitive for each new row count").
#pragma once

#include <torch/extension.h>

constexpr int64_t kRowQuantum = 16;  // layers.py ROW_QUANTUM

// An empty [rows, cols] tensor whose storage holds rows rounded up to kRowQuantum, the
// spare rows zeroed (a matmul over them reads zeros, never stale values).
inline at::Tensor empty_padded_rows(int64_t rows, int64_t cols, const at::TensorOptions& options) {
  const int64_t padded = (rows + kRowQuantum - 1) / kRowQuantum * kRowQuantum;
  auto full = at::empty({padded, cols}, options);
  if (padded > rows) full.narrow(0, rows, padded - rows).zero_();
  return full.narrow(0, 0, rows);
}
