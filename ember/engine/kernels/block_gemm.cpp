// y = x W^T for a few rows of float32 x, W kept as the GGUF file's quantized blocks
// (Q4_0, Q4_1, Q8_0: 32 weights per block), on whichever vector ISA this build is
// for (simd.h).
//
// The fp32 weights ember loads from such a file are exactly what these blocks decode to:
// every block value is a 4- or 8-bit integer times an fp16 scale (plus an fp16 minimum for
// Q4_1); the product is exact in fp32, so one fused multiply-add rounds the way the
// loader's `d * q + m` does. Decoding in registers therefore reproduces the fp32 weights
// bit for bit, while a decode step streams 0.56-1.06 bytes per weight instead of 4.
// The arithmetic is small_gemm.cpp's, in the same order (one vector of k at a time, M x R
// register accumulators, one reduction at the end), so the results are bit-identical
// to small_gemm on the dequantized weights.
//
// Layouts (d, m: fp16; q: 4-bit, low nibbles hold weights 0-15, high nibbles 16-31):
//   Q4_0  18 bytes  [d | 16 bytes q]    w = d * (q - 8)
//   Q4_1  20 bytes  [d | m | 16 bytes q] w = d * q + m
//   Q8_0  34 bytes  [d | 32 int8 q]     w = q * d
// The block size tells the formats apart; W is [out_features, row_bytes] uint8.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

namespace {

using simd::kLanes;
using simd::vf;

constexpr int64_t kBlockWeights = 32;
constexpr int kChunks = kBlockWeights / kLanes;  // vectors per block
constexpr int kMaxRows = 8;  // rows of x per pass over W (register accumulators)

// Each format decodes one block into its kChunks vectors of weights, in order.
// The 4-bit formats keep weights 0-15 in the low nibbles of their 16 bytes, 16-31 in the
// high ones.
template <typename Decode>
inline void nibble_halves(const uint8_t* q, vf* out, const Decode& decode) {
  for (int c = 0; c < kChunks / 2; ++c) {
    vf low, high;
    simd::nibbles(q + c * kLanes, low, high);
    out[c] = decode(low);
    out[kChunks / 2 + c] = decode(high);
  }
}

struct Q4_0 {
  static constexpr int64_t kBytes = 18;
  static inline void decode(const uint8_t* block, vf* out) {
    const vf d = simd::set1(simd::half_at(block)), eight = simd::set1(8.f);
    nibble_halves(block + 2, out, [&](vf q) { return simd::mul(d, simd::sub(q, eight)); });
  }
};

struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static inline void decode(const uint8_t* block, vf* out) {
    const vf d = simd::set1(simd::half_at(block)), m = simd::set1(simd::half_at(block + 2));
    // d * q is exact: one rounding, fused or not
    nibble_halves(block + 4, out, [&](vf q) { return simd::fma(q, d, m); });
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static inline void decode(const uint8_t* block, vf* out) {
    const vf d = simd::set1(simd::half_at(block));
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int c = 0; c < kChunks; ++c) out[c] = simd::mul(simd::from_i8(q + c * kLanes), d);
  }
};

// R rows of W against M rows of x, as in small_gemm.cpp: the R rows' blocks are decoded
// once into registers and used for every row of x. M x R accumulators, R x kChunks
// decoded vectors and kChunks of x must fit in the registers (32 with AVX-512, 16
// otherwise), which sets R for each M.
template <int M>
constexpr int rows_per_group() {
  if (kLanes == 16) return M <= 4 ? 4 : 2;
  return M <= 2 ? 2 : 1;
}

template <int M, int R, typename F>
void row_group(const float* x, const uint8_t* w, float* y, int64_t k_dim, int64_t n_dim,
               int64_t row_bytes, int64_t j) {
  vf acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = simd::zero();
  const uint8_t* w0 = w + j * row_bytes;
  // The next group's rows follow these: prefetch them, spread over this loop.
  const char* ahead = reinterpret_cast<const char*>(w0 + R * row_bytes);
  constexpr int64_t ahead_step = R * F::kBytes;  // bytes of W one block step reads
  for (int64_t b = 0; b < k_dim / kBlockWeights; ++b) {
    for (int64_t o = 0; o < ahead_step; o += 64) simd::prefetch(ahead + o);
    simd::prefetch(ahead + ahead_step - 1);
    ahead += ahead_step;
    vf weights[R][kChunks];
    for (int r = 0; r < R; ++r) F::decode(w0 + r * row_bytes + b * F::kBytes, weights[r]);
    const float* xb = x + b * kBlockWeights;
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < kChunks; ++c) {
        const vf xv = simd::load(xb + m * k_dim + c * kLanes);
        for (int r = 0; r < R; ++r) acc[m][r] = simd::fma(xv, weights[r][c], acc[m][r]);
      }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_dim + j + r] = simd::reduce_add(acc[m][r]);
}

template <int M, typename F>
void block_gemm_m(const float* x, const uint8_t* w, float* y, int64_t k_dim, int64_t n_dim,
                  int64_t row_bytes) {
  constexpr int R = rows_per_group<M>();
  at::parallel_for(0, n_dim / R, 64 / R, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      row_group<M, R, F>(x, w, y, k_dim, n_dim, row_bytes, g * R);
  });
}

template <typename F>
void block_gemm_rows(int64_t rows, const float* x, const uint8_t* w, float* y, int64_t k_dim,
                     int64_t n_dim, int64_t row_bytes) {
  switch (rows) {
    case 1: block_gemm_m<1, F>(x, w, y, k_dim, n_dim, row_bytes); break;
    case 2: block_gemm_m<2, F>(x, w, y, k_dim, n_dim, row_bytes); break;
    case 3: block_gemm_m<3, F>(x, w, y, k_dim, n_dim, row_bytes); break;
    case 4: block_gemm_m<4, F>(x, w, y, k_dim, n_dim, row_bytes); break;
    case 5: block_gemm_m<5, F>(x, w, y, k_dim, n_dim, row_bytes); break;
    case 6: block_gemm_m<6, F>(x, w, y, k_dim, n_dim, row_bytes); break;
    case 7: block_gemm_m<7, F>(x, w, y, k_dim, n_dim, row_bytes); break;
    default: block_gemm_m<8, F>(x, w, y, k_dim, n_dim, row_bytes); break;
  }
}

template <typename F>
void block_gemm_all(int64_t rows, const float* x, const uint8_t* w, float* y, int64_t k_dim,
                    int64_t n_dim) {
  const int64_t row_bytes = k_dim / kBlockWeights * F::kBytes;
  // more rows than the registers hold: one pass over W per group of kMaxRows
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows)
    block_gemm_rows<F>(std::min<int64_t>(kMaxRows, rows - m0), x + m0 * k_dim, w,
                       y + m0 * n_dim, k_dim, n_dim, row_bytes);
}

}  // namespace

bool block_gemm_supported(int64_t in_features, int64_t out_features) {
  return in_features % kBlockWeights == 0 && out_features % 4 == 0;
}

torch::Tensor block_gemm(torch::Tensor x, torch::Tensor blocks, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && blocks.dtype() == torch::kUInt8,
              "block_gemm: float32 x, uint8 blocks");
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, "block_gemm: 2-D x and blocks");
  x = x.contiguous();
  TORCH_CHECK(blocks.is_contiguous(), "block_gemm: contiguous blocks");
  const int64_t rows = x.size(0), k_dim = x.size(1), n_dim = blocks.size(0);
  TORCH_CHECK(rows >= 1 && block_gemm_supported(k_dim, n_dim),
              "block_gemm: in_features % 32 == 0, out_features % 4 == 0");
  auto y = torch::empty({rows, n_dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t block_bytes = blocks.size(1) / (k_dim / kBlockWeights);
  TORCH_CHECK(blocks.size(1) == block_bytes * (k_dim / kBlockWeights),
              "block_gemm: row bytes are not a whole number of blocks");
  switch (block_bytes) {
    case Q4_0::kBytes: block_gemm_all<Q4_0>(rows, xp, wp, yp, k_dim, n_dim); break;
    case Q4_1::kBytes: block_gemm_all<Q4_1>(rows, xp, wp, yp, k_dim, n_dim); break;
    case Q8_0::kBytes: block_gemm_all<Q8_0>(rows, xp, wp, yp, k_dim, n_dim); break;
    default: TORCH_CHECK(false, "block_gemm: ", block_bytes, "-byte blocks are not Q4_0, Q4_1 or Q8_0");
  }
  if (bias.has_value()) y.add_(*bias);
  return y;
}

void register_block_gemm(pybind11::module& m) {
  m.def("block_gemm", &block_gemm, "x W^T (+ b), W as GGUF Q4_0 / Q4_1 / Q8_0 blocks");
  m.def("block_gemm_supported", &block_gemm_supported, "whether block_gemm takes these shapes");
}
