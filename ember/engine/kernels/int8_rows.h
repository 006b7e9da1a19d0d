// x's rows quantized to int8 per 32 values, as the int8 block GEMMs take them
// (block_gemm.cpp's block_gemm_int8, int8_tiles.cpp's tiled_gemm_int8): x ~ dx * q,
// dx = max |x| / 127, q = x * (127 / max |x|) rounded to nearest (ties to even), as
// llama.cpp's Q8_0 activations.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace int8_rows {

constexpr int kGroup = 32;  // values per scale

struct QuantizedRows {
  std::vector<int8_t> q;          // [rows, k]
  std::vector<float> scale;       // dx: [rows, k / 32]
  std::vector<float> group_sums;  // dx * (sum of q over each 32): [rows, k / 32]
  std::vector<int16_t> sums16;    // sum of q over each 16: [rows, k / 16] (Q6_K)
};

inline QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t k_dim) {
  QuantizedRows out;
  out.q.resize(rows * k_dim);
  out.scale.resize(rows * k_dim / kGroup);
  out.group_sums.resize(rows * k_dim / kGroup);
  out.sums16.resize(rows * k_dim / 16);
  constexpr int kChunks = kGroup / simd::kLanes;
  // a prefill's rows on every thread (760 x 1536 values: ~0.1 ms); a decode's few, here
  at::parallel_for(0, rows * k_dim / kGroup, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* xg = x + g * kGroup;
      simd::vf values[kChunks], amax = simd::zero();
      for (int c = 0; c < kChunks; ++c) {
        values[c] = simd::load(xg + c * simd::kLanes);
        amax = simd::max(amax, simd::abs(values[c]));
      }
      const float largest = simd::reduce_max(amax);
      const float d = largest / 127.f, inverse = largest > 0.f ? 127.f / largest : 0.f;
      int8_t* q = out.q.data() + g * kGroup;
      int sum[2] = {0, 0};
      for (int c = 0; c < kChunks; ++c)
        sum[c * simd::kLanes / 16] += simd::round_to_int8(
            simd::mul(values[c], simd::set1(inverse)), q + c * simd::kLanes);
      out.scale[g] = d;
      out.group_sums[g] = d * static_cast<float>(sum[0] + sum[1]);
      out.sums16[2 * g] = static_cast<int16_t>(sum[0]);
      out.sums16[2 * g + 1] = static_cast<int16_t>(sum[1]);
    }
  });
  return out;
}

}  // namespace int8_rows
