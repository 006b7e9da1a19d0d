// y = x W^T for a handful of rows of x (decode of 2-8 sequences), float32 x and y,
// W float32 or bfloat16 (widened to float32 in registers: half the bytes to stream), on
// whichever vector ISA this build is for (simd.h).
//
// A decode step is memory-bound: every weight must be read once, and that read is the
// whole cost. General GEMMs (MKL, oneDNN) pay packing or blocking overheads sized for
// large M; here each group of R weight rows is streamed once, one vector at a time, into
// M x R vector accumulators held in registers (x stays in L1), then reduced:
//
//            k ->  [16 floats]
//   W rows j..j+3  w0 w1 w2 w3          acc[m][r] += x[m][k:k+16] * w_r[k:k+16]
//   x rows 0..M-1  x0 .. x(M-1)         y[m][j+r]  = sum(acc[m][r])
#include "kernels.h"
#include <ATen/Parallel.h>

#include "simd.h"
#include "work_chunks.h"

namespace {

using simd::kLanes;
using simd::vf;

// R rows of W against M rows of x. M x R accumulators, R weight vectors and one x vector
// must fit in the registers (32 with AVX-512, 16 otherwise), which sets R for each M.
template <int M>
constexpr int rows_per_group() {
  if (kLanes == 16) return 4;
  return M <= 2 ? 4 : M <= 6 ? 2 : 1;
}

template <int M, int R, typename W>
void row_group(const float* x, const W* w, float* y, int64_t k_dim, int64_t n_dim, int64_t j) {
  vf acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = simd::zero();
  const W* w0 = w + j * k_dim;
  // The next group's rows follow these in memory: prefetch them, spread over this loop
  // (the hardware prefetcher alone left 4-8 row batches ~25% short of stream speed).
  const char* ahead = reinterpret_cast<const char*>(w0 + R * k_dim);
  constexpr int64_t ahead_step = R * kLanes * sizeof(W);  // bytes of W one iteration reads
  for (int64_t k = 0; k < k_dim; k += kLanes) {
    for (int64_t b = 0; b < ahead_step; b += 64) simd::prefetch(ahead + b);
    ahead += ahead_step;
    vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = simd::load(w0 + r * k_dim + k);
    for (int m = 0; m < M; ++m) {
      const vf xv = simd::load(x + m * k_dim + k);
      for (int r = 0; r < R; ++r) acc[m][r] = simd::fma(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_dim + j + r] = simd::reduce_add(acc[m][r]);
}

template <int M, typename W>
void small_gemm_m(const float* x, const W* w, float* y, int64_t k_dim, int64_t n_dim) {
  constexpr int R = rows_per_group<M>();
  parallel_chunks(n_dim / R, 64 / R, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) row_group<M, R, W>(x, w, y, k_dim, n_dim, g * R);
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

at::Tensor small_gemm(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dtype() == at::kFloat &&
                  (weight.dtype() == at::kFloat || weight.dtype() == at::kBFloat16),
              "small_gemm: float32 x, float32 or bfloat16 weight");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_gemm: contiguous");
  const int64_t rows = x.size(0), k_dim = x.size(1), n_dim = weight.size(0);
  TORCH_CHECK(small_gemm_supported(rows, k_dim, n_dim) && weight.size(1) == k_dim,
              "small_gemm: 1-8 rows, in_features % 16 == 0, out_features % 4 == 0");
  auto y = at::empty({rows, n_dim}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (weight.dtype() == at::kBFloat16)
    small_gemm_rows(rows, xp, weight.data_ptr<c10::BFloat16>(), yp, k_dim, n_dim);
  else
    small_gemm_rows(rows, xp, weight.data_ptr<float>(), yp, k_dim, n_dim);
  if (bias.has_value()) y.add_(*bias);
  return y;
}
