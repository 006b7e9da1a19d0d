// Decode attention straight over the paged KV cache (one query token per sequence).
//
// Reads each sequence's keys and values in place, block by block, once per KV head:
// no gathered copy of the context. Work is split over (sequence, KV head) pairs; the
// query heads that share a KV head are handled together so each key is loaded once.
//
// q:            [num_seqs, num_heads, head_dim]                  float32, contiguous
// key_cache:    [num_blocks, block_size, num_kv_heads, head_dim]  float32, contiguous
// value_cache:  same as key_cache
// block_tables: [num_seqs, max_blocks] int64
// context_lens: [num_seqs] int64 (tokens to attend to, the query's own included)
// returns       [num_seqs, num_heads, head_dim]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#include <sleef.h>  // torch's copy; libtorch_cpu exports the functions
#endif

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// row[0:n] = softmax(row[0:n]) in place. exp is torch's own vectorized one (SLEEF's
// 1-ulp expf, what torch.exp and torch.softmax run on AVX-512): std::exp one value at a
// time took most of a decode step's attention.
inline void softmax_(float* row, int64_t n) {
  float peak = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : peak)
  for (int64_t t = 0; t < n; ++t) peak = std::max(peak, row[t]);
#ifdef __AVX512F__
  const __m512 shift = _mm512_set1_ps(peak);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 lanes = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, row + t);
    const __m512 e = _mm512_maskz_mov_ps(lanes, Sleef_expf16_u10(_mm512_sub_ps(x, shift)));
    _mm512_mask_storeu_ps(row + t, lanes, e);
    sums = _mm512_add_ps(sums, e);
  }
  const float inv = 1.f / _mm512_reduce_add_ps(sums);
#else
  float total = 0.f;
  for (int64_t t = 0; t < n; ++t) total += (row[t] = std::exp(row[t] - peak));
  const float inv = 1.f / total;
#endif
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) row[t] *= inv;
}

#ifdef __AVX512F__
// q . k for head_dim % 16 == 0: independent accumulators, one reduction (the compiler's
// own vectorization of `dot` chained every FMA through one 8-float register)
inline float dot16(const float* a, const float* b, int64_t n) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  for (int64_t i = 0; i < n; i += 16)
    acc[(i >> 4) & 3] =
        _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc[(i >> 4) & 3]);
  return _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

// out[0 : 16 C] = sum over t of p[t] * value(t)[0 : 16 C], the sums held in registers
template <int C, typename ValueAt>
void weighted_sum(const float* p, int64_t len, const ValueAt& value_at, float* out) {
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const __m512 weight = _mm512_set1_ps(p[t]);
    const float* value = value_at(t);
    for (int c = 0; c < C; ++c)
      acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + 16 * c), acc[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

// The head sizes with register-held sums; others take the scalar-loop path.
template <typename ValueAt>
bool weighted_sum_fast(const float* p, int64_t len, const ValueAt& value_at, float* out,
                       int64_t head_dim) {
  switch (head_dim) {
    case 64: weighted_sum<4>(p, len, value_at, out); return true;
    case 128: weighted_sum<8>(p, len, value_at, out); return true;
    default: return false;
  }
}
#endif

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && key_cache.dtype() == torch::kFloat32,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode_attention: contiguous tensors only");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  auto out = torch::zeros_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = key_cache.data_ptr<float>();
  const float* v_ptr = value_cache.data_ptr<float>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t token_stride = num_kv_heads * head_dim;
  const float fscale = static_cast<float>(scale);
  const auto score = [head_dim](const float* a, const float* b) {
#ifdef __AVX512F__
    if (head_dim % 16 == 0) return dot16(a, b, head_dim);
#endif
    return dot(a, b, head_dim);
  };

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t seq = work / num_kv_heads, kv_head = work % num_kv_heads;
      const int64_t len = len_ptr[seq];
      TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "bad context length");
      scores.assign(group * len, 0.f);
      const float* q_seq = q_ptr + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t t = 0; t < len; ++t) {  // scores = q . k, block by block
        const int64_t block = table_ptr[seq * max_blocks + t / block_size];
        const float* key = k_ptr + (block * block_size + t % block_size) * token_stride +
                           kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g)
          scores[g * len + t] = score(q_seq + g * head_dim, key) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) softmax_(scores.data() + g * len, len);
      float* out_seq = out_ptr + (seq * num_heads + kv_head * group) * head_dim;
#ifdef __AVX512F__
      const auto value_at = [&](int64_t t) {
        const int64_t block = table_ptr[seq * max_blocks + t / block_size];
        return v_ptr + (block * block_size + t % block_size) * token_stride + kv_head * head_dim;
      };
      bool done = true;
      for (int64_t g = 0; g < group && done; ++g)
        done = weighted_sum_fast(scores.data() + g * len, len, value_at, out_seq + g * head_dim,
                                 head_dim);
      if (done) continue;
#endif
      for (int64_t t = 0; t < len; ++t) {  // out = p . v
        const int64_t block = table_ptr[seq * max_blocks + t / block_size];
        const float* value = v_ptr + (block * block_size + t % block_size) * token_stride +
                             kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g)
          axpy(scores[g * len + t], value, out_seq + g * head_dim, head_dim);
      }
    }
  });
  return out;
}

void register_layer_kernels(pybind11::module& m);  // layers.cpp
void register_decode_layer(pybind11::module& m);   // decode_layer.cpp
void register_small_gemm(pybind11::module& m);     // small_gemm.cpp
void register_block_gemm(pybind11::module& m);     // block_gemm.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (CPU, float32)");
  register_layer_kernels(m);
  register_decode_layer(m);
  register_small_gemm(m);
  register_block_gemm(m);
}
