// Prefill attention straight over the paged KV cache: one chunk of a sequence's prompt,
// causal, attending to every earlier token of the sequence (a prefix-cache hit, an
// earlier chunk) and to itself.
//
// torch's SDPA needed the context gathered into one tensor, and a boolean mask whenever
// the chunk had context before it; its CPU kernel then did every query-key pair (a mask
// skips nothing) at ~40-60% of this CPU's float32 rate for 64-wide heads. Here:
//   - each KV head's keys are transposed once, a vector of kLanes keys per dimension, into
//     a scratch buffer all of the head's query tiles share;
//   - a tile of R query rows (tokens x the query heads sharing the KV head) keeps its R
//     score vectors in registers while the head's dimensions stream past: one key load
//     feeds R multiply-adds;
//   - softmax is online (a running max and sum per row, the output rescaled when the max
//     grows), in float32; key tiles past a query tile's last position are never touched,
//     and only the tiles across the diagonal are masked.
//
// q:            [T, num_heads, head_dim]                          float32, contiguous
// key_cache:    [num_blocks, block_size, num_kv_heads, head_dim]  float32, contiguous
// value_cache:  same as key_cache
// block_table:  [>= ceil(context_len / block_size)] int64, the sequence's blocks
// context_len:  tokens of context after this chunk; query i sits at context_len - T + i
// returns       [T, num_heads, head_dim] float32
// head_dim must be 2, 4 or 8 vectors (`prefill_head_dims` lists them).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using simd::kLanes;

// Query rows per tile: the score vectors held in registers (32 vector registers on
// AVX-512, 16 on AVX2 and on the generic path's SSE2/NEON targets)
#if defined(__AVX512F__)
constexpr int kRows = 24, kVectorRegisters = 32;
#else
constexpr int kRows = 12, kVectorRegisters = 16;
#endif

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// keys_t[tile][d][lane] = key (tile * kLanes + lane), dimension d, of one KV head; lanes
// past the context are zero (their scores are masked)
void transpose_keys(const float* keys, const int64_t* table, int64_t context_len,
                    int64_t block_size, int64_t token_stride, int64_t head_dim, int64_t tile,
                    float* out) {
  const int64_t first = tile * kLanes;
  for (int lane = 0; lane < kLanes; ++lane) {
    const int64_t t = first + lane;
    if (t >= context_len) {
      for (int64_t d = 0; d < head_dim; ++d) out[d * kLanes + lane] = 0.f;
      continue;
    }
    const float* key =
        keys + (table[t / block_size] * block_size + t % block_size) * token_stride;
    for (int64_t d = 0; d < head_dim; ++d) out[d * kLanes + lane] = key[d];
  }
}

// One tile of kRows query rows of one KV head, NV vectors per head. rows[r] points at
// query row r (padding rows at a zero row: they are computed like the others and never
// stored), pos[r] is its position, out[r] receives its normalized output.
template <int NV>
void attend_tile(const float* const* rows, const int64_t* pos, int num_rows,
                 const float* keys_t, const float* values, const int64_t* table,
                 int64_t block_size, int64_t token_stride, float scale, float* const* out) {
  constexpr int64_t head_dim = NV * kLanes;
  constexpr int R = kRows;
  // rows summed together in the value pass: their RP x NV sums and one value's NV vectors
  // fit the registers, so each value vector loaded feeds RP multiply-adds
  constexpr int kFit = (kVectorRegisters - 2) / NV - 1;
  constexpr int RP = kFit >= 4 ? 4 : (kFit >= 2 ? 2 : 1);
  static_assert(R % RP == 0, "row groups must divide the tile");
  int64_t last = 0, first = pos[0];  // keys after the tile's last position are never seen
  for (int r = 0; r < num_rows; ++r) {
    last = std::max(last, pos[r]);
    first = std::min(first, pos[r]);
  }
  const int64_t num_tiles = last / kLanes + 1;

  alignas(64) float queries[head_dim][R];  // transposed: one row's broadcast per address
  for (int r = 0; r < R; ++r)
    for (int64_t d = 0; d < head_dim; ++d) queries[d][r] = rows[r][d];
  alignas(64) float scores[R][kLanes];
  alignas(64) float sums_out[R][head_dim];
  float peak[R], total[R], shrink[R];
  for (int r = 0; r < R; ++r) {
    peak[r] = kNegInf;
    total[r] = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) sums_out[r][d] = 0.f;
  }
  const float* value_ptr[kLanes];
  const simd::vf vscale = simd::set1(scale);

  for (int64_t tile = 0; tile < num_tiles; ++tile) {
    // scores[r] = q_r . keys of this tile, R vectors in registers
    simd::vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = simd::zero();
    const float* kt = keys_t + tile * head_dim * kLanes;
    for (int64_t d = 0; d < head_dim; ++d) {
      const simd::vf key = simd::load(kt + d * kLanes);
      for (int r = 0; r < R; ++r) acc[r] = simd::fma(simd::set1(queries[d][r]), key, acc[r]);
    }
    for (int r = 0; r < R; ++r) simd::store(scores[r], simd::mul(acc[r], vscale));

    const int64_t start = tile * kLanes;
    const int64_t span = std::min<int64_t>(kLanes, last + 1 - start);  // keys of this tile seen
    if (start + kLanes - 1 > first) {  // across the diagonal: mask keys after each row
      for (int r = 0; r < R; ++r)
        for (int lane = 0; lane < kLanes; ++lane)
          if (start + lane > pos[r]) scores[r][lane] = kNegInf;
    }
    for (int64_t i = 0; i < span; ++i) {
      const int64_t t = start + i;
      value_ptr[i] = values + (table[t / block_size] * block_size + t % block_size) * token_stride;
    }

    // online softmax: scores become weights against each row's running maximum
    for (int r = 0; r < R; ++r) {
      float* s = scores[r];
      float tile_peak = kNegInf;
      for (int lane = 0; lane < kLanes; ++lane) tile_peak = std::max(tile_peak, s[lane]);
      if (tile_peak == kNegInf) {  // every key of this tile is after the row
        simd::store(s, simd::zero());
        shrink[r] = 1.f;
        continue;
      }
      const float new_peak = std::max(peak[r], tile_peak);
      shrink[r] = peak[r] == kNegInf ? 0.f : (new_peak == peak[r] ? 1.f : std::exp(peak[r] - new_peak));
      peak[r] = new_peak;
      const simd::vf e = simd::exp(simd::sub(simd::load(s), simd::set1(new_peak)));
      simd::store(s, e);
      total[r] = total[r] * shrink[r] + simd::reduce_add(e);
    }

    // sums_out[r] = sums_out[r] * shrink[r] + sum over keys i of weight[r][i] * value(i)
    for (int r0 = 0; r0 < R; r0 += RP) {
      simd::vf sums[RP][NV];
      for (int g = 0; g < RP; ++g) {
        const simd::vf vs = simd::set1(shrink[r0 + g]);
        for (int c = 0; c < NV; ++c)
          sums[g][c] = simd::mul(simd::load(sums_out[r0 + g] + c * kLanes), vs);
      }
      for (int64_t i = 0; i < span; ++i) {
        simd::vf value[NV];
        for (int c = 0; c < NV; ++c) value[c] = simd::load(value_ptr[i] + c * kLanes);
        for (int g = 0; g < RP; ++g) {
          const simd::vf weight = simd::set1(scores[r0 + g][i]);
          for (int c = 0; c < NV; ++c) sums[g][c] = simd::fma(weight, value[c], sums[g][c]);
        }
      }
      for (int g = 0; g < RP; ++g)
        for (int c = 0; c < NV; ++c) simd::store(sums_out[r0 + g] + c * kLanes, sums[g][c]);
    }
  }
  for (int r = 0; r < num_rows; ++r) {
    const simd::vf inv = simd::set1(1.f / total[r]);
    for (int c = 0; c < NV; ++c)
      simd::store(out[r] + c * kLanes, simd::mul(simd::load(sums_out[r] + c * kLanes), inv));
  }
}

using TileFn = void (*)(const float* const*, const int64_t*, int, const float*, const float*,
                        const int64_t*, int64_t, int64_t, float, float* const*);

TileFn tile_for(int64_t head_dim) {
  if (head_dim == 2 * kLanes) return &attend_tile<2>;
  if (head_dim == 4 * kLanes) return &attend_tile<4>;
  if (head_dim == 8 * kLanes) return &attend_tile<8>;
  return nullptr;
}

}  // namespace

torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor key_cache,
                                      torch::Tensor value_cache, torch::Tensor block_table,
                                      int64_t context_len, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && key_cache.dtype() == torch::kFloat32 &&
                  value_cache.dtype() == torch::kFloat32,
              "paged_prefill_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_prefill_attention: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "paged_prefill_attention: q [T, H, D]");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "paged_prefill_attention: head shapes");
  const TileFn attend = tile_for(head_dim);
  TORCH_CHECK(attend != nullptr, "paged_prefill_attention: head_dim ", head_dim,
              " is not 2, 4 or 8 vectors of ", kLanes);
  auto table = block_table.to(torch::kInt64).contiguous();
  TORCH_CHECK(context_len >= num_tokens && num_tokens >= 1 &&
                  table.numel() * block_size >= context_len,
              "paged_prefill_attention: context_len");
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < (context_len + block_size - 1) / block_size; ++b)
    TORCH_CHECK(table_ptr[b] >= 0 && table_ptr[b] < key_cache.size(0),
                "paged_prefill_attention: block id out of range");

  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t num_key_tiles = (context_len + kLanes - 1) / kLanes;
  const int64_t tile_floats = head_dim * kLanes;
  std::vector<float> keys_t(num_kv_heads * num_key_tiles * tile_floats);
  const float* k_ptr = key_cache.data_ptr<float>();
  const float* v_ptr = value_cache.data_ptr<float>();
  at::parallel_for(0, num_kv_heads * num_key_tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t work = begin; work < end; ++work) {
      const int64_t head = work / num_key_tiles, tile = work % num_key_tiles;
      transpose_keys(k_ptr + head * head_dim, table_ptr, context_len, block_size, token_stride,
                     head_dim, tile, keys_t.data() + work * tile_floats);
    }
  });

  auto out = torch::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t rows_per_head = num_tokens * group;  // row = token * group + g
  const int64_t tiles_per_head = (rows_per_head + kRows - 1) / kRows;
  const int64_t first_pos = context_len - num_tokens;
  const float fscale = static_cast<float>(scale);
  std::vector<float> zero_row(head_dim, 0.f);
  at::parallel_for(0, num_kv_heads * tiles_per_head, 1, [&](int64_t begin, int64_t end) {
    const float* rows[kRows];
    float* outs[kRows];
    int64_t pos[kRows];
    for (int64_t work = begin; work < end; ++work) {
      // tiles from both ends of the chunk in turn: later rows see more keys, and each
      // thread's run of work items then holds cheap and dear tiles alike
      const int64_t head = work / tiles_per_head, turn = work % tiles_per_head;
      const int64_t tile = turn % 2 == 0 ? turn / 2 : tiles_per_head - 1 - turn / 2;
      const int64_t row0 = tile * kRows;
      const int num_rows = static_cast<int>(std::min<int64_t>(kRows, rows_per_head - row0));
      for (int r = 0; r < kRows; ++r) {
        if (r < num_rows) {
          const int64_t row = row0 + r, token = row / group, g = row % group;
          const int64_t offset = (token * num_heads + head * group + g) * head_dim;
          rows[r] = q_ptr + offset;
          outs[r] = out_ptr + offset;
          pos[r] = first_pos + token;
        } else {
          rows[r] = zero_row.data();
          outs[r] = nullptr;
          pos[r] = first_pos;
        }
      }
      attend(rows, pos, num_rows, keys_t.data() + head * num_key_tiles * tile_floats,
             v_ptr + head * head_dim, table_ptr, block_size, token_stride, fscale, outs);
    }
  });
  return out;
}

void register_prefill_attention(pybind11::module& m) {
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal prefill attention of one chunk over a paged KV cache (CPU, float32)");
  m.attr("prefill_head_dims") = std::vector<int64_t>{2 * kLanes, 4 * kLanes, 8 * kLanes};
}
