// Fused elementwise kernels for the decoder layer (CPU, float32; silu_and_mul also bf16, for
// bf16 prefill steps): each replaces a handful of torch ops, which at decode batch sizes
// cost more in dispatch than in math.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <exception>
#include <limits>
#include <type_traits>
#include <vector>

#include "cache_types.h"
#include "padded_rows.h"
#include "simd.h"
#include "work_chunks.h"

namespace {

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": 2-D with contiguous rows");
}

}  // namespace

namespace {

// residual rows += delta rows (float32 or bf16, widened exactly), when given; then
// out = weight * (residual * inv_rms), float32 or rounded once to bf16 (nearest even, as
// torch's .to(torch.bfloat16) rounds): each float32 value computed as the float32 norm
// computes it, so a bf16 out equals that norm's output rounded.
template <class D, class O>
void add_rms_norm_rows(float* res, int64_t res_stride, const D* add, int64_t add_stride,
                       const float* w, O* o, int64_t rows, int64_t dim, float eps) {
  parallel_chunks(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = res + r * res_stride;
      if (add) {
        const D* d = add + r * add_stride;
        int64_t i = 0;
        for (; i + simd::kLanes <= dim; i += simd::kLanes)
          simd::store(x + i, simd::add(simd::load(x + i), simd::load(d + i)));
        for (; i < dim; ++i) x[i] += static_cast<float>(d[i]);
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) sum += x[i] * x[i];
      const float inv = 1.f / std::sqrt(sum / dim + eps);
      O* y = o + r * dim;
      const simd::vf vinv = simd::set1(inv);
      int64_t i = 0;
      for (; i + simd::kLanes <= dim; i += simd::kLanes)
        simd::store(y + i, simd::mul(simd::load(w + i), simd::mul(simd::load(x + i), vinv)));
      for (; i < dim; ++i) y[i] = static_cast<O>(w[i] * (x[i] * inv));
    }
  });
}

}  // namespace

// residual += delta (when given), then returns rms_norm(residual) * weight, like
// transformers' `hidden = residual + delta; norm(hidden)` in float32. The residual is
// float32; delta float32 or bf16 (a bf16 matmul's output); `bf16_out` returns the norm
// rounded to bf16 (for a bf16 matmul next), else float32.
at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta,
                        at::Tensor weight, double eps, bool bf16_out) {
  check_float_rows(residual, "add_rms_norm");
  TORCH_CHECK(weight.dtype() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == residual.size(1),
              "add_rms_norm: a float32 weight per column");
  const int64_t rows = residual.size(0), dim = residual.size(1);
  auto out = bf16_out ? empty_padded_rows(rows, dim, residual.options().dtype(at::kBFloat16))
                      : at::empty({rows, dim}, residual.options());
  const bool bf16_delta = delta.has_value() && delta->dtype() == at::kBFloat16;
  if (delta.has_value()) {
    TORCH_CHECK(delta->dtype() == at::kFloat || bf16_delta, "add_rms_norm: float32 or bf16 delta");
    TORCH_CHECK(delta->dim() == 2 && delta->size(0) == rows && delta->size(1) == dim &&
                    delta->stride(1) == 1,
                "add_rms_norm: delta rows");
  }
  float* res = residual.data_ptr<float>();
  const int64_t res_stride = residual.stride(0), add_stride = delta.has_value() ? delta->stride(0) : 0;
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  auto run = [&](auto* add) {
    if (bf16_out) {
      add_rms_norm_rows(res, res_stride, add, add_stride, w,
                        reinterpret_cast<c10::BFloat16*>(out.data_ptr<at::BFloat16>()), rows, dim, e);
    } else {
      add_rms_norm_rows(res, res_stride, add, add_stride, w, out.data_ptr<float>(), rows, dim, e);
    }
  };
  if (bf16_delta) {
    run(reinterpret_cast<const c10::BFloat16*>(delta->data_ptr<at::BFloat16>()));
  } else {
    run(delta.has_value() ? static_cast<const float*>(delta->data_ptr<float>()) : nullptr);
  }
  return out;
}

namespace {

// n values from src to dst: float32 as they are, bf16 widened (exactly) to float32, or
// float32 rounded to bf16 (nearest even, as torch's .to(torch.bfloat16) rounds)
inline void store_row(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
template <class From, class To>
inline void store_row(const From* src, To* dst, int64_t n) {
  int64_t i = 0;
  for (; i + simd::kLanes <= n; i += simd::kLanes) simd::store(dst + i, simd::load(src + i));
  for (; i < n; ++i) dst[i] = static_cast<To>(static_cast<float>(src[i]));
}

// rotate-half rotary embedding of one head's float32 values in place, with the token's
// cos / sin rows: the one definition both entry points below use, so they round alike
inline void rotate_head(float* v, const float* ct, const float* st, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * ct[i] - b * st[i];
    v[i + half] = b * ct[i + half] + a * st[i + half];
  }
}

}  // namespace

// In place, rotate-half rotary embedding of x [T, heads, D] (token rows may be strided,
// heads and dims contiguous) with cos/sin [T, D].
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 3, "rotary_: float32 [T, H, D]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary_: contiguous heads");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  auto c = cos.contiguous(), s = sin.contiguous();
  float* base = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  const int64_t stride = x.stride(0);
  parallel_chunks(tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(base + t * stride + h * dim, cp + t * dim, sp + t * dim, half);
  });
}

// A bf16 step's fused q/k/v [T, (H + 2 Hkv) D] (a bf16 matmul's output) split and rotated
// in one pass: q [T, H, D] rotated and rounded back to bf16 (for bf16 attention), k rotated
// and v as they are, in float32 [T, Hkv, D] (for the cache): what widening qkv, rotary_ on
// q and k, and rounding q give, without the whole widened copy.
std::vector<at::Tensor> rotary_split_bf16(at::Tensor qkv, at::Tensor cos,
                                          at::Tensor sin, int64_t num_heads,
                                          int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dtype() == at::kBFloat16 && qkv.dim() == 2 && qkv.stride(1) == 1,
              "rotary_split_bf16: bf16 [T, (H + 2 Hkv) D] with contiguous rows");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && qkv.size(1) % (num_heads + 2 * num_kv_heads) == 0,
              "rotary_split_bf16: head counts");
  const int64_t tokens = qkv.size(0), dim = qkv.size(1) / (num_heads + 2 * num_kv_heads);
  TORCH_CHECK(dim % 2 == 0 && cos.dtype() == at::kFloat && sin.dtype() == at::kFloat &&
                  cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "rotary_split_bf16: float32 cos, sin [T, D]");
  auto c = cos.contiguous(), s = sin.contiguous();
  auto q = at::empty({tokens, num_heads, dim}, qkv.options());
  auto k = at::empty({tokens, num_kv_heads, dim}, qkv.options().dtype(at::kFloat));
  auto v = at::empty_like(k);
  const auto* in = reinterpret_cast<const c10::BFloat16*>(qkv.data_ptr<at::BFloat16>());
  auto* qp = reinterpret_cast<c10::BFloat16*>(q.data_ptr<at::BFloat16>());
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  const int64_t in_stride = qkv.stride(0), q_width = num_heads * dim, kv_width = num_kv_heads * dim;
  parallel_chunks(tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* src = in + t * in_stride;
      const float* ct = cp + t * dim;
      const float* st = sp + t * dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        store_row(src + h * dim, row.data(), dim);
        rotate_head(row.data(), ct, st, dim / 2);
        store_row(row.data(), qp + t * q_width + h * dim, dim);
      }
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        float* key = kp + t * kv_width + h * dim;
        store_row(src + q_width + h * dim, key, dim);
        rotate_head(key, ct, st, dim / 2);
      }
      store_row(src + q_width + kv_width, vp + t * kv_width, kv_width);
    }
  });
  return {q, k, v};
}

// silu(gate) * up for gate_up [T, 2I] -> [T, I], float32 or bf16 (out in the same dtype,
// a bf16 result rounded once from the float32 product), in one pass over the rows. The
// AVX-512 and AVX2 builds' bf16 one takes e^-|g| inline (simd::exp2_bounded, within 3e-6; bf16
// keeps 2^-8), and so does their float32 one with `approx_exp` (for a product that the
// next matmul rounds to int8 per 32 values, or to bf16, anyway): silu(g) = g / (1 + e^-|g|)
// for g >= 0, g e^-|g| / (1 + e^-|g|) below, the division a reciprocal's estimate and a
// Newton step. Sleef's exp, a call per vector, was most of its time once; the division and a
// degree-7 series after it (30 layers' distinct 519 x 3,072 inputs, 2 threads: 11.7-12.0 ->
// 10.6-11.4 ms, most of it memory's).
namespace {
inline simd::vf silu(simd::vf g, bool fast_exp) {
#if defined(__AVX512F__)
  if (fast_exp) {
    const simd::vf t = _mm512_mul_ps(_mm512_abs_ps(g), _mm512_set1_ps(-1.44269504f));  // -|g| log2 e
    const simd::vf e = simd::exp2_bounded(t);
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const simd::vf den = _mm512_add_ps(_mm512_set1_ps(1.f), e);
    return _mm512_mul_ps(_mm512_mask_mul_ps(g, negative, g, e), simd::reciprocal(den));
  }
#elif defined(__AVX2__)
  if (fast_exp) {  // the same on 8 lanes (30 layers of 288 rows x 1,536 on a Zen 4: 14.2 -> 6.7 ms)
    const simd::vf magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.f), g);
    const simd::vf e = simd::exp2_bounded(_mm256_mul_ps(magnitude, _mm256_set1_ps(-1.44269504f)));
    const simd::vf negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const simd::vf den = _mm256_add_ps(_mm256_set1_ps(1.f), e);
    const simd::vf num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), negative);
    return _mm256_mul_ps(num, simd::reciprocal(den));
  }
#endif
  return simd::div(g, simd::add(simd::set1(1.f), simd::exp(simd::sub(simd::zero(), g))));
}
}  // namespace

template <class T>
void silu_mul_rows(const T* in, int64_t in_stride, T* out, int64_t rows, int64_t inter,
                   bool approx_exp) {
  const bool fast_exp = approx_exp || !std::is_same_v<T, float>;
  parallel_chunks(rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * in_stride;
      const T* up = gate + inter;
      T* y = out + r * inter;
      int64_t i = 0;
      for (; i + simd::kLanes <= inter; i += simd::kLanes) {
        const simd::vf g = simd::load(gate + i);
        simd::store(y + i, simd::mul(silu(g, fast_exp), simd::load(up + i)));
      }
      for (; i < inter; ++i) {
        const float g = static_cast<float>(gate[i]);
        y[i] = static_cast<T>(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(at::Tensor gate_up, bool approx_exp) {
  TORCH_CHECK(gate_up.dtype() == at::kFloat || gate_up.dtype() == at::kBFloat16,
              "silu_and_mul: float32 or bfloat16");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: 2-D [T, 2I] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = gate_up.dtype() == at::kBFloat16 ? empty_padded_rows(rows, inter, gate_up.options())
                                              : at::empty({rows, inter}, gate_up.options());
  if (gate_up.dtype() == at::kFloat) {
    silu_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), rows, inter,
                  approx_exp);
  } else {
    silu_mul_rows(reinterpret_cast<const c10::BFloat16*>(gate_up.data_ptr<at::BFloat16>()),
                  gate_up.stride(0), reinterpret_cast<c10::BFloat16*>(out.data_ptr<at::BFloat16>()),
                  rows, inter, true);
  }
  return out;
}

// Stores k and v [T, Hkv, D] (token rows may be strided) at flat slots of the caches
// [num_blocks, block_size, Hkv, D]: float32 as they are, or rounded to bfloat16 (nearest
// even, as torch's .to(torch.bfloat16) rounds).
void write_kv(at::Tensor k, at::Tensor v, at::Tensor key_cache,
              at::Tensor value_cache, at::Tensor slots) {
  TORCH_CHECK(k.dtype() == at::kFloat && v.dtype() == at::kFloat, "write_kv: float32 k, v");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "write_kv: contiguous caches");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2), "write_kv: contiguous k heads");
  TORCH_CHECK(v.stride(2) == 1 && v.stride(1) == v.size(2), "write_kv: contiguous v heads");
  const int64_t tokens = k.size(0), width = k.size(1) * k.size(2);
  auto slot = slots.to(at::kLong).contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  with_cache_type(key_cache, value_cache, "write_kv", [&](auto element) {
    using T = decltype(element);
    T* kc = static_cast<T*>(key_cache.data_ptr());
    T* vc = static_cast<T*>(value_cache.data_ptr());
    // a step's slots are distinct: a prompt chunk's rows go on the threads at once
    parallel_chunks(tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        store_row(kp + t * ks, kc + sp[t] * width, width);
        store_row(vp + t * vs, vc + sp[t] * width, width);
      }
    });
  });
}

// oneDNN's packed-weight matmul (torch's mkldnn::_linear_pointwise) on `parts` row ranges
// of x at once, one range per thread, each call single-threaded inside the parallel
// region; the results concatenated in order. For shapes whose whole call oneDNN runs on
// one thread: on an AMX Xeon, a 576-wide output from 1,536 inputs at 512 rows took as
// long on two threads as on one, and 1.6x less split in two (docs/benchmarks.md). Each
// range is what the matmul gives for those rows alone (the same bits as calling it on them).
at::Tensor linear_split_rows(at::Tensor x, at::Tensor packed,
                             c10::optional<at::Tensor> bias, int64_t parts) {
  TORCH_CHECK(x.dim() == 2 && parts >= 1, "linear_split_rows: 2-D x, parts >= 1");
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  const int64_t rows = x.size(0);
  parts = std::max<int64_t>(1, std::min(parts, rows));
  std::vector<at::Tensor> outs(parts);
  const at::ThreadLocalState state;  // inference mode and the rest, in every thread
  std::exception_ptr failure;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int64_t i = 0; i < parts; ++i) {
    try {
      at::ThreadLocalStateGuard guard(state);
      const int64_t begin = rows * i / parts, end = rows * (i + 1) / parts;
      outs[i] = op.call(x.narrow(0, begin, end - begin), packed, bias, "none",
                        c10::List<std::optional<c10::Scalar>>(), "");
    } catch (...) {
#pragma omp critical
      failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
  return at::cat(outs);
}

namespace {

// One row's argmax as torch's argmax gives it: the first of equal maxima, the first NaN
// where the row has one. One pass of vector compares: each lane keeps its largest value
// and where it first came (a strict >, so a lane keeps its first of equal ones), then the
// best of the lanes and the tail, the lowest index among equal values. A NaN is never
// larger, so it is looked for beside the maxima, and then found by a scan.
int64_t argmax_row(const float* x, int64_t n) {
  constexpr int kWays = simd::kLanes;
  const int64_t whole = n / kWays * kWays;
  alignas(64) float best[kWays];
  alignas(64) int32_t at[kWays];  // a row of under 2^31 values (checked)
  bool nan = false;
#if defined(__AVX512F__)
  __m512 top_v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at_v = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i index = at_v;
  __mmask16 unordered = 0;
  for (int64_t j = 0; j < whole; j += kWays) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 more = _mm512_cmp_ps_mask(v, top_v, _CMP_GT_OQ);
    top_v = _mm512_mask_mov_ps(top_v, more, v);
    at_v = _mm512_mask_mov_epi32(at_v, more, index);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    index = _mm512_add_epi32(index, _mm512_set1_epi32(kWays));
  }
  _mm512_store_ps(best, top_v);
  _mm512_store_si512(at, at_v);
  nan = unordered != 0;
#elif defined(__AVX2__)
  __m256 top_v = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i at_v = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i index = at_v;
  __m256 unordered = _mm256_setzero_ps();
  for (int64_t j = 0; j < whole; j += kWays) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256 more = _mm256_cmp_ps(v, top_v, _CMP_GT_OQ);
    top_v = _mm256_blendv_ps(top_v, v, more);
    at_v = _mm256_blendv_epi8(at_v, index, _mm256_castps_si256(more));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    index = _mm256_add_epi32(index, _mm256_set1_epi32(kWays));
  }
  _mm256_store_ps(best, top_v);
  _mm256_store_si256(reinterpret_cast<__m256i*>(at), at_v);
  nan = _mm256_movemask_ps(unordered) != 0;
#else
  for (int l = 0; l < kWays; ++l) best[l] = -std::numeric_limits<float>::infinity(), at[l] = l;
  for (int64_t j = 0; j < whole; j += kWays)
    for (int l = 0; l < kWays; ++l) {
      const float v = x[j + l];
      if (v > best[l]) best[l] = v, at[l] = static_cast<int32_t>(j + l);
      nan |= v != v;
    }
#endif
  float top = -std::numeric_limits<float>::infinity();
  int64_t where = 0;
  for (int l = 0; l < kWays && l < whole; ++l)
    if (best[l] > top || (best[l] == top && at[l] < where)) top = best[l], where = at[l];
  for (int64_t j = whole; j < n; ++j) {
    nan |= x[j] != x[j];
    if (x[j] > top) top = x[j], where = j;
  }
  if (nan)
    for (int64_t j = 0; j < n; ++j)
      if (x[j] != x[j]) return j;
  return where;
}

}  // namespace

// Each row's argmax over float32 x [R, N] with contiguous rows, int64 [R]: the token
// greedy decoding takes, and the exponential race's draw (ember.engine.sampler). torch's
// max(dim) with indices took 227 us for 8 rows of SmolLM2's 49,152 logits (2-core Zen 5),
// its amax without them 12.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= 1,
              "argmax_rows: float32 [R, N] with contiguous rows, N >= 1");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "argmax_rows: rows of under 2^31 values");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  parallel_chunks(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = argmax_row(data + r * stride, n);
  });
  return out;
}
