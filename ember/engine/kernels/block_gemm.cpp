// y = x W^T for a few rows of float32 x, W kept as the GGUF file's quantized blocks
// (Q4_0, Q4_1, Q8_0: 32 weights per block), AVX-512.
//
// The fp32 weights ember loads from such a file are exactly what these blocks decode to:
// every block value is a 4- or 8-bit integer times an fp16 scale (plus an fp16 minimum for
// Q4_1); the product is exact in fp32, so one fused multiply-add rounds the way the
// loader's `d * q + m` does. Decoding in registers therefore reproduces the fp32 weights
// bit for bit, while a decode step streams 0.56-1.06 bytes per weight instead of 4.
// The arithmetic is small_gemm.cpp's, in the same order (16-float chunks of k, M x 4
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

#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>

namespace {

constexpr int64_t kBlockWeights = 32;
constexpr int kMaxRows = 8;  // rows of x per pass over W (register accumulators)

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

struct Q4_0 {
  static constexpr int64_t kBytes = 18;
  static inline void decode(const uint8_t* block, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(half_at(block));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2)));
    const __m512i eight = _mm512_set1_epi32(8);
    const __m512i q_lo = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)), eight);
    const __m512i q_hi = _mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight);
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q_lo));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q_hi));
  }
};

struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static inline void decode(const uint8_t* block, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(half_at(block));
    const __m512 m = _mm512_set1_ps(half_at(block + 2));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
    const __m512i q_lo = _mm512_and_si512(q, _mm512_set1_epi32(0x0F));
    const __m512i q_hi = _mm512_srli_epi32(q, 4);
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q_lo), d, m);  // d * q is exact: one rounding
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q_hi), d, m);
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static inline void decode(const uint8_t* block, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(half_at(block));
    const __m128i* q = reinterpret_cast<const __m128i*>(block + 2);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
  }
};

// R consecutive rows of W against M rows of x: the R rows' blocks are decoded once into
// registers and used for every row of x. M x R accumulators + 2R decoded + 2 x vectors
// must fit in the 32 zmm registers, so R is 4 up to M = 4 and 2 beyond.
template <int M, int R, typename F>
void row_group(const float* x, const uint8_t* w, float* y, int64_t k_dim, int64_t n_dim,
               int64_t row_bytes, int64_t j) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint8_t* w0 = w + j * row_bytes;
  // The next group's rows follow these: prefetch them, spread over this loop.
  const char* ahead = reinterpret_cast<const char*>(w0 + R * row_bytes);
  constexpr int64_t ahead_step = R * F::kBytes;  // bytes of W one block step reads
  for (int64_t b = 0; b < k_dim / kBlockWeights; ++b) {
    for (int64_t o = 0; o < ahead_step; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    _mm_prefetch(ahead + ahead_step - 1, _MM_HINT_T0);
    ahead += ahead_step;
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) F::decode(w0 + r * row_bytes + b * F::kBytes, lo[r], hi[r]);
    const float* xb = x + b * kBlockWeights;
    for (int m = 0; m < M; ++m) {
      const __m512 x_lo = _mm512_loadu_ps(xb + m * k_dim);
      const __m512 x_hi = _mm512_loadu_ps(xb + m * k_dim + 16);
      for (int r = 0; r < R; ++r) {
        acc[m][r] = _mm512_fmadd_ps(x_lo, lo[r], acc[m][r]);
        acc[m][r] = _mm512_fmadd_ps(x_hi, hi[r], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_dim + j + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int M, typename F>
void block_gemm_m(const float* x, const uint8_t* w, float* y, int64_t k_dim, int64_t n_dim,
                  int64_t row_bytes) {
  constexpr int R = M <= 4 ? 4 : 2;
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
#else
bool block_gemm_supported(int64_t, int64_t) { return false; }
torch::Tensor block_gemm(torch::Tensor x, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "block_gemm: built without AVX-512");
  return x;
}
#endif

void register_block_gemm(pybind11::module& m) {
  m.def("block_gemm", &block_gemm, "x W^T (+ b), W as GGUF Q4_0 / Q4_1 / Q8_0 blocks (AVX-512)");
  m.def("block_gemm_supported", &block_gemm_supported, "whether block_gemm takes these shapes");
}
