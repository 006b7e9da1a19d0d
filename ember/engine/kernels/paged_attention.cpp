// Decode attention straight over the paged KV cache (one query token per sequence).
//
// Reads each sequence's keys and values in place, block by block, once per KV head:
// no gathered copy of the context. Work is split over (sequence, KV head) pairs; the
// query heads that share a KV head are handled together so each key is loaded once.
//
// q:            [num_seqs, num_heads, head_dim]                  float32, contiguous
// key_cache:    [num_blocks, block_size, num_kv_heads, head_dim]  float32 or bfloat16,
//               contiguous (a bf16 cache is widened as it is read: the sums are those of
//               a float32 cache holding the same values, bit for bit)
// value_cache:  same as key_cache
// block_tables: [num_seqs, max_blocks] int64
// context_lens: [num_seqs] int64 (tokens to attend to, the query's own included)
// returns       [num_seqs, num_heads, head_dim]
#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cache_types.h"
#include "simd.h"
#include "work_chunks.h"

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

// A cache row as floats: a float32 cache's own, a bf16 cache's widened into `scratch` (the
// general path below then runs the same float code on both)
inline const float* as_floats(const float* row, int64_t, float*) { return row; }
inline const float* as_floats(const c10::BFloat16* row, int64_t n, float* scratch) {
  for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<float>(row[i]);
  return scratch;
}

// row[0:n] = softmax(row[0:n]) in place. exp is a vectorized one (SLEEF's 1-ulp expf,
// what torch.exp and torch.softmax run, on the x86 paths): std::exp one value at a time
// took most of a decode step's attention.
inline void softmax_(float* row, int64_t n) {
  float peak = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : peak)
  for (int64_t t = 0; t < n; ++t) peak = std::max(peak, row[t]);
  const simd::vf shift = simd::set1(peak);
  simd::vf sums = simd::zero();
  int64_t t = 0;
  for (; t + simd::kLanes <= n; t += simd::kLanes) {
    const simd::vf e = simd::exp(simd::sub(simd::load(row + t), shift));
    simd::store(row + t, e);
    sums = simd::add(sums, e);
  }
  float total = simd::reduce_add(sums);
  for (; t < n; ++t) total += (row[t] = std::exp(row[t] - peak));
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) row[t] *= inv;
}

// q . k for head_dim a multiple of the vector width: independent accumulators, one
// reduction (the compiler's own vectorization of `dot` chained every FMA through one
// register)
inline float dot_lanes(const float* a, const float* b, int64_t n) {
  using simd::kLanes;
  simd::vf acc[4] = {simd::zero(), simd::zero(), simd::zero(), simd::zero()};
  for (int64_t i = 0; i < n; i += kLanes)
    acc[(i / kLanes) & 3] = simd::fma(simd::load(a + i), simd::load(b + i), acc[(i / kLanes) & 3]);
  return simd::reduce_add(simd::add(simd::add(acc[0], acc[1]), simd::add(acc[2], acc[3])));
}

// out[0 : C lanes] = sum over t of p[t] * value(t)[0 : C lanes], the sums held in registers
template <int C, typename ValueAt>
void weighted_sum(const float* p, int64_t len, const ValueAt& value_at, float* out,
                  int64_t offset) {
  simd::vf acc[C];
  for (int c = 0; c < C; ++c) acc[c] = simd::zero();
  for (int64_t t = 0; t < len; ++t) {
    const simd::vf weight = simd::set1(p[t]);
    const auto* value = value_at(t) + offset;
    for (int c = 0; c < C; ++c)
      acc[c] = simd::fma(weight, simd::load(value + simd::kLanes * c), acc[c]);
  }
  for (int c = 0; c < C; ++c) simd::store(out + offset + simd::kLanes * c, acc[c]);
}

// Head sizes that are whole numbers of 4 vectors have register-held sums, taken 8 vectors
// of columns at a time where they divide the head (128 floats with AVX-512, 64 with
// 8-lane vectors), else 4; others take the scalar-loop path.
template <typename ValueAt>
bool weighted_sum_fast(const float* p, int64_t len, const ValueAt& value_at, float* out,
                       int64_t head_dim) {
  constexpr int64_t wide = 8 * simd::kLanes, narrow = 4 * simd::kLanes;
  if (head_dim % wide == 0) {
    for (int64_t offset = 0; offset < head_dim; offset += wide)
      weighted_sum<8>(p, len, value_at, out, offset);
    return true;
  }
  if (head_dim % narrow == 0) {
    for (int64_t offset = 0; offset < head_dim; offset += narrow)
      weighted_sum<4>(p, len, value_at, out, offset);
    return true;
  }
  return false;
}

// Asks for the cache lines of elements [p, p + count) ahead of use
template <typename T>
inline void prefetch(const T* p, int64_t count) {
  for (int64_t i = 0; i < count; i += 64 / sizeof(T)) __builtin_prefetch(p + i);
}

// Calls visit(t, vectors) for each token t < len of one KV head's context (keys or values,
// `base` pointing at the head in block 0), its NV vectors loaded, walking the blocks of
// `table` in order (no division per token) and fetching the next block's lines ahead.
template <int NV, typename T, typename Visit>
inline void walk_context(const T* base, const int64_t* table, int64_t len,
                         int64_t block_size, int64_t token_stride, const Visit& visit) {
  constexpr int64_t head_dim = NV * simd::kLanes;
  const int64_t block_stride = block_size * token_stride;
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const T* token = base + table[b] * block_stride;
    const T* ahead = b + 1 < num_blocks ? base + table[b + 1] * block_stride : nullptr;
    const int64_t n = std::min(block_size, len - start);
    for (int64_t i = 0; i < n; ++i, token += token_stride) {
      if (ahead != nullptr) prefetch(ahead + i * token_stride, head_dim);
      simd::vf vectors[NV];
      for (int c = 0; c < NV; ++c) vectors[c] = simd::load(token + c * simd::kLanes);
      visit(start + i, vectors);
    }
  }
}

// One (sequence, KV head) of decode attention when the head is NV whole vectors and G query
// heads share the KV head: the G queries stay in registers, every key and value is loaded
// once for all of them, and the context is walked block by block.
// The arithmetic is dot_lanes' and weighted_sum's, in the same order: results are
// bit-identical to the general path below.
template <int NV, int G, typename T>
void attend_kv_head(const float* q, const T* keys, const T* values, const int64_t* table,
                    int64_t len, int64_t block_size, int64_t token_stride, float scale,
                    float* scores, float* out) {
  using simd::kLanes;
  constexpr int64_t head_dim = NV * kLanes;
  simd::vf qv[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) qv[g][c] = simd::load(q + g * head_dim + c * kLanes);
  walk_context<NV>(keys, table, len, block_size, token_stride,
                   [&](int64_t t, const simd::vf* key) {
                     for (int g = 0; g < G; ++g) {
                       simd::vf acc[4] = {simd::zero(), simd::zero(), simd::zero(), simd::zero()};
                       for (int c = 0; c < NV; ++c)
                         acc[c & 3] = simd::fma(qv[g][c], key[c], acc[c & 3]);
                       const simd::vf sum =
                           simd::add(simd::add(acc[0], acc[1]), simd::add(acc[2], acc[3]));
                       scores[g * len + t] = simd::reduce_add(sum) * scale;
                     }
                   });
  for (int g = 0; g < G; ++g) softmax_(scores + g * len, len);
  simd::vf acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = simd::zero();
  walk_context<NV>(values, table, len, block_size, token_stride,
                   [&](int64_t t, const simd::vf* value) {
                     for (int g = 0; g < G; ++g) {
                       const simd::vf weight = simd::set1(scores[g * len + t]);
                       for (int c = 0; c < NV; ++c)
                         acc[g][c] = simd::fma(weight, value[c], acc[g][c]);
                     }
                   });
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) simd::store(out + g * head_dim + c * kLanes, acc[g][c]);
}

template <typename T>
using AttendFn = void (*)(const float*, const T*, const T*, const int64_t*, int64_t, int64_t,
                          int64_t, float, float*, float*);

// The fast path for this head shape, or null: heads of 2, 4 or 8 vectors, up to 8 query
// heads per KV head, as long as the sums fit the vector registers (G * NV <= 24)
template <int NV, typename T>
AttendFn<T> attend_for_group(int64_t group) {
  switch (group) {
    case 1: return &attend_kv_head<NV, 1, T>;
    case 2: return &attend_kv_head<NV, 2, T>;
    case 3: return NV * 3 <= 24 ? &attend_kv_head<NV, 3, T> : nullptr;
    case 4: return NV * 4 <= 24 ? &attend_kv_head<NV, 4, T> : nullptr;
    case 5: return NV * 5 <= 24 ? &attend_kv_head<NV, 5, T> : nullptr;
    case 6: return NV * 6 <= 24 ? &attend_kv_head<NV, 6, T> : nullptr;
    case 8: return NV * 8 <= 24 ? &attend_kv_head<NV, 8, T> : nullptr;
    default: return nullptr;
  }
}

template <typename T>
AttendFn<T> attend_for(int64_t head_dim, int64_t group) {
  if (head_dim == 2 * simd::kLanes) return attend_for_group<2, T>(group);
  if (head_dim == 4 * simd::kLanes) return attend_for_group<4, T>(group);
  if (head_dim == 8 * simd::kLanes) return attend_for_group<8, T>(group);
  return nullptr;
}

template <typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  const float* q_ptr = q.data_ptr<float>();
  const T* k_ptr = static_cast<const T*>(key_cache.data_ptr());
  const T* v_ptr = static_cast<const T*>(value_cache.data_ptr());
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t token_stride = num_kv_heads * head_dim;
  const float fscale = static_cast<float>(scale);
  const auto score = [head_dim](const float* a, const float* b) {
    if (head_dim % simd::kLanes == 0) return dot_lanes(a, b, head_dim);
    return dot(a, b, head_dim);
  };

  const AttendFn<T> attend = attend_for<T>(head_dim, group);

  parallel_chunks(num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, scratch(head_dim);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t seq = work / num_kv_heads, kv_head = work % num_kv_heads;
      const int64_t len = len_ptr[seq];
      TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "bad context length");
      scores.assign(group * len, 0.f);
      const float* q_seq = q_ptr + (seq * num_heads + kv_head * group) * head_dim;
      if (attend != nullptr) {
        attend(q_seq, k_ptr + kv_head * head_dim, v_ptr + kv_head * head_dim,
               table_ptr + seq * max_blocks, len, block_size, token_stride, fscale,
               scores.data(), out_ptr + (seq * num_heads + kv_head * group) * head_dim);
        continue;
      }
      for (int64_t t = 0; t < len; ++t) {  // scores = q . k, block by block
        const int64_t block = table_ptr[seq * max_blocks + t / block_size];
        const float* key = as_floats(k_ptr + (block * block_size + t % block_size) * token_stride +
                                         kv_head * head_dim, head_dim, scratch.data());
        for (int64_t g = 0; g < group; ++g)
          scores[g * len + t] = score(q_seq + g * head_dim, key) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) softmax_(scores.data() + g * len, len);
      float* out_seq = out_ptr + (seq * num_heads + kv_head * group) * head_dim;
      const auto value_at = [&](int64_t t) {
        const int64_t block = table_ptr[seq * max_blocks + t / block_size];
        return v_ptr + (block * block_size + t % block_size) * token_stride + kv_head * head_dim;
      };
      bool done = true;
      for (int64_t g = 0; g < group && done; ++g)
        done = weighted_sum_fast(scores.data() + g * len, len, value_at, out_seq + g * head_dim,
                                 head_dim);
      if (done) continue;
      for (int64_t t = 0; t < len; ++t) {  // out = p . v
        const int64_t block = table_ptr[seq * max_blocks + t / block_size];
        const float* value = as_floats(v_ptr + (block * block_size + t % block_size) * token_stride +
                                           kv_head * head_dim, head_dim, scratch.data());
        for (int64_t g = 0; g < group; ++g)
          axpy(scores[g * len + t], value, out_seq + g * head_dim, head_dim);
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor key_cache,
                                  at::Tensor value_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dtype() == at::kFloat, "paged_decode_attention: float32 q");
  TORCH_CHECK(q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode_attention: contiguous tensors only");
  auto out = at::zeros_like(q);
  with_cache_type(key_cache, value_cache, "paged_decode_attention", [&](auto element) {
    decode_attention<decltype(element)>(q, key_cache, value_cache, block_tables, context_lens,
                                        scale, out);
  });
  return out;
}
