// y = x W^T for a handful of rows of x (decode of 2-8 sequences), float32 x and y,
// W float32 or bfloat16 (widened to float32 in registers: half the bytes to stream), AVX-512.
//
// A decode step is memory-bound: every weight must be read once, and that read is the
// whole cost. General GEMMs (MKL, oneDNN) pay packing or blocking overheads sized for
// large M; here each group of 4 weight rows is streamed once, 16 floats at a time, into
// M x 4 vector accumulators held in registers (x stays in L1), then reduced:
//
//            k ->  [16 floats]
//   W rows j..j+3  w0 w1 w2 w3          acc[m][r] += x[m][k:k+16] * w_r[k:k+16]
//   x rows 0..M-1  x0 .. x(M-1)         y[m][j+r]  = sum(acc[m][r])
#include <torch/extension.h>
#include <ATen/Parallel.h>

#ifdef __AVX512F__
#include <immintrin.h>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// bf16 is the top half of a float32: widen each 16-bit lane and shift it up
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <int M, typename W>
void rows_of_four(const float* x, const W* w, float* y, int64_t k_dim, int64_t n_dim,
                  int64_t j) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  const W* w0 = w + j * k_dim;
  // The next group's 4 rows follow these in memory: prefetch them, spread over this loop
  // (the hardware prefetcher alone left 4-8 row batches ~25% short of stream speed).
  const char* ahead = reinterpret_cast<const char*>(w0 + 4 * k_dim);
  constexpr int64_t ahead_step = 4 * 16 * sizeof(W);  // bytes of W one iteration reads
  for (int64_t k = 0; k < k_dim; k += 16) {
    for (int64_t b = 0; b < ahead_step; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    ahead += ahead_step;
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = load16(w0 + r * k_dim + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * k_dim + k);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < 4; ++r) y[m * n_dim + j + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int M, typename W>
void small_gemm_m(const float* x, const W* w, float* y, int64_t k_dim, int64_t n_dim) {
  at::parallel_for(0, n_dim / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) rows_of_four<M, W>(x, w, y, k_dim, n_dim, g * 4);
  });
}

template <typename W>
void small_gemm_rows(int64_t rows, const float* x, const W* w, float* y, int64_t k_dim,
                     int64_t n_dim) {
  switch (rows) {
    case 1: small_gemm_m<1>(x, w, y, k_dim, n_dim); break;
    case 2: small_gemm_m<2>(x, w, y, k_dim, n_dim); break;
    case 3: small_gemm_m<3>(x, w, y, k_dim, n_dim); break;
    case 4: small_gemm_m<4>(x, w, y, k_dim, n_dim); break;
    case 5: small_gemm_m<5>(x, w, y, k_dim, n_dim); break;
    case 6: small_gemm_m<6>(x, w, y, k_dim, n_dim); break;
    case 7: small_gemm_m<7>(x, w, y, k_dim, n_dim); break;
    default: small_gemm_m<8>(x, w, y, k_dim, n_dim); break;
  }
}

}  // namespace

bool small_gemm_supported(int64_t rows, int64_t in_features, int64_t out_features) {
  return rows >= 1 && rows <= 8 && in_features % 16 == 0 && out_features % 4 == 0;
}

torch::Tensor small_gemm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 &&
                  (weight.dtype() == torch::kFloat32 || weight.dtype() == torch::kBFloat16),
              "small_gemm: float32 x, float32 or bfloat16 weight");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_gemm: contiguous");
  const int64_t rows = x.size(0), k_dim = x.size(1), n_dim = weight.size(0);
  TORCH_CHECK(small_gemm_supported(rows, k_dim, n_dim) && weight.size(1) == k_dim,
              "small_gemm: 1-8 rows, in_features % 16 == 0, out_features % 4 == 0");
  auto y = torch::empty({rows, n_dim}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (weight.dtype() == torch::kBFloat16)
    small_gemm_rows(rows, xp, weight.data_ptr<c10::BFloat16>(), yp, k_dim, n_dim);
  else
    small_gemm_rows(rows, xp, weight.data_ptr<float>(), yp, k_dim, n_dim);
  if (bias.has_value()) y.add_(*bias);
  return y;
}
#else
bool small_gemm_supported(int64_t, int64_t, int64_t) { return false; }
torch::Tensor small_gemm(torch::Tensor x, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "small_gemm: built without AVX-512");
  return x;
}
#endif

void register_small_gemm(pybind11::module& m) {
  m.def("small_gemm", &small_gemm, "x W^T (+ b) for 1-8 rows of x (AVX-512)");
  m.def("small_gemm_supported", &small_gemm_supported, "whether small_gemm takes these shapes");
}
