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
// paged_prefill_attention_bf16 is the same walk for a bf16 step: bf16 q, the keys and values
// rounded to bf16 pairs as they are transposed, the softmax weights rounded to bf16, and
// every product a bf16 pair's (AVX512-BF16's vdpbf16ps where the CPU has it: twice the
// multiply-adds per instruction; elsewhere float FMAs that give the same sums, which every
// build runs and the tests hold the former to). Scores, softmax and sums stay float32.
//
// q:            [T, num_heads, head_dim]                          float32, contiguous
// key_cache:    [num_blocks, block_size, num_kv_heads, head_dim]  float32 or bfloat16,
//               contiguous (cache_types.h)
// value_cache:  same as key_cache
// block_table:  [>= ceil(context_len / block_size)] int64, the sequence's blocks
// context_len:  tokens of context after this chunk; query i sits at context_len - T + i
// returns       [T, num_heads, head_dim] float32
// head_dim must be 2, 4 or 8 vectors (`prefill_head_dims` lists them).
#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "cache_types.h"
#include "padded_rows.h"
#include "simd.h"
#include "work_chunks.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using simd::kLanes;

// Query rows per tile: the score vectors held in registers (32 vector registers on
// AVX-512, 16 on AVX2 and on the generic path's SSE2/NEON targets)
#if defined(__AVX512F__)
constexpr int kRows = 24, kVectorRegisters = 32;
#else
constexpr int kRows = 12, kVectorRegisters = 16;
#endif

// Where token t of a sequence sits in a cache [blocks, block_size, kv_heads, D] with
// token_stride elements per token, by its block table
inline int64_t token_offset(const int64_t* table, int64_t t, int64_t block_size, int64_t token_stride) {
  return (table[t / block_size] * block_size + t % block_size) * token_stride;
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// keys_t[tile][d][lane] = key (tile * kLanes + lane), dimension d, of one KV head; lanes
// past the context are zero (their scores are masked)
template <typename T>
void transpose_keys(const T* keys, const int64_t* table, int64_t context_len,
                    int64_t block_size, int64_t token_stride, int64_t head_dim, int64_t tile,
                    float* out) {
  const int64_t first = tile * kLanes;
  for (int lane = 0; lane < kLanes; ++lane) {
    const int64_t t = first + lane;
    if (t >= context_len) {
      for (int64_t d = 0; d < head_dim; ++d) out[d * kLanes + lane] = 0.f;
      continue;
    }
    const T* key = keys + token_offset(table, t, block_size, token_stride);
    for (int64_t d = 0; d < head_dim; ++d) out[d * kLanes + lane] = static_cast<float>(key[d]);
  }
}

// One tile of kRows query rows of one KV head, NV vectors per head. rows[r] points at
// query row r (padding rows at a zero row: they are computed like the others and never
// stored), pos[r] is its position, out[r] receives its normalized output.
template <int NV, typename T>
void attend_tile(const float* const* rows, const int64_t* pos, int num_rows,
                 const float* keys_t, const T* values, const int64_t* table,
                 int64_t block_size, int64_t token_stride, float scale, float* const* out) {
  constexpr int64_t head_dim = NV * kLanes;
  constexpr int R = kRows;
  // the value pass takes NP of a head's vectors at a time and RP rows together: their
  // RP x NP sums and one value's NP vectors fit the registers, so each value vector loaded
  // feeds RP multiply-adds (a whole head where two rows fit, else half of one: 64-wide
  // heads on the 16 registers of AVX2)
  constexpr int NP = (kVectorRegisters - 2) / NV - 1 >= 2 ? NV : NV / 2;
  constexpr int kFit = (kVectorRegisters - 2) / NP - 1;
  constexpr int RP = kFit >= 4 ? 4 : (kFit >= 2 ? 2 : 1);
  static_assert(R % RP == 0 && NV % NP == 0, "row groups must divide the tile");
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
  alignas(64) float totals[R][kLanes];  // each row's softmax sum, lane by lane
  float peak[R], shrink[R];
  for (int r = 0; r < R; ++r) {
    peak[r] = kNegInf;
    simd::store(totals[r], simd::zero());
    for (int64_t d = 0; d < head_dim; ++d) sums_out[r][d] = 0.f;
  }
  // a tile's values as float32 rows: a float32 cache's own, a bf16 cache's widened once a
  // tile into `widened` (the value pass reads each value once per row group: widening
  // there cost a bf16 cache ~0.4 ms a layer of a 286-token prompt on a Zen 4's AVX2 build)
  const float* value_rows[kLanes];
  alignas(64) float widened[std::is_same_v<T, float> ? 1 : kLanes * head_dim];
  const simd::vf vscale = simd::set1(scale);

  for (int64_t tile = 0; tile < num_tiles; ++tile) {
    // scores[r] = q_r . keys of this tile, R vectors in registers
    simd::vf acc[R];
    // the R sums stay in registers only with the row loops unrolled (rolled, GCC 12 kept
    // them in memory: a load and a store around every product, docs/benchmarks.md)
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) acc[r] = simd::zero();
    const float* kt = keys_t + tile * head_dim * kLanes;
    for (int64_t d = 0; d < head_dim; ++d) {
      const simd::vf key = simd::load(kt + d * kLanes);
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) acc[r] = simd::fma(simd::set1(queries[d][r]), key, acc[r]);
    }
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) simd::store(scores[r], simd::mul(acc[r], vscale));

    const int64_t start = tile * kLanes;
    const int64_t span = std::min<int64_t>(kLanes, last + 1 - start);  // keys of this tile seen
    if (start + kLanes - 1 > first) {  // across the diagonal: mask keys after each row
      for (int r = 0; r < R; ++r)
        for (int lane = 0; lane < kLanes; ++lane)
          if (start + lane > pos[r]) scores[r][lane] = kNegInf;
    }
    for (int64_t i = 0; i < span; ++i) {
      const T* value = values + token_offset(table, start + i, block_size, token_stride);
      if constexpr (std::is_same_v<T, float>) {
        value_rows[i] = value;
      } else {
        float* row = widened + i * head_dim;
        for (int c = 0; c < NV; ++c) simd::store(row + c * kLanes, simd::load(value + c * kLanes));
        value_rows[i] = row;
      }
    }

    // online softmax: scores become weights against each row's running maximum
    for (int r = 0; r < R; ++r) {
      float* s = scores[r];
      const float tile_peak = simd::reduce_max(simd::load(s));
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
      simd::store(totals[r], simd::fma(simd::load(totals[r]), simd::set1(shrink[r]), e));
    }

    // sums_out[r] = sums_out[r] * shrink[r] + sum over keys i of weight[r][i] * value(i)
    // (a row group whose maxima all held skips the multiply by 1)
    for (int r0 = 0; r0 < R; r0 += RP) {
      bool held = true;
      for (int g = 0; g < RP; ++g) held = held && shrink[r0 + g] == 1.f;
      for (int c0 = 0; c0 < NV; c0 += NP) {
        simd::vf sums[RP][NP];
        for (int g = 0; g < RP; ++g) {
          const simd::vf vs = simd::set1(shrink[r0 + g]);
          for (int c = 0; c < NP; ++c) {
            sums[g][c] = simd::load(sums_out[r0 + g] + (c0 + c) * kLanes);
            if (!held) sums[g][c] = simd::mul(sums[g][c], vs);
          }
        }
        for (int64_t i = 0; i < span; ++i) {
          simd::vf value[NP];
          for (int c = 0; c < NP; ++c) value[c] = simd::load(value_rows[i] + (c0 + c) * kLanes);
          for (int g = 0; g < RP; ++g) {
            const simd::vf weight = simd::set1(scores[r0 + g][i]);
            for (int c = 0; c < NP; ++c) sums[g][c] = simd::fma(weight, value[c], sums[g][c]);
          }
        }
        for (int g = 0; g < RP; ++g)
          for (int c = 0; c < NP; ++c) simd::store(sums_out[r0 + g] + (c0 + c) * kLanes, sums[g][c]);
      }
    }
  }
  for (int r = 0; r < num_rows; ++r) {
    const simd::vf inv = simd::set1(1.f / simd::reduce_add(simd::load(totals[r])));
    for (int c = 0; c < NV; ++c)
      simd::store(out[r] + c * kLanes, simd::mul(simd::load(sums_out[r] + c * kLanes), inv));
  }
}

template <typename T>
using TileFn = void (*)(const float* const*, const int64_t*, int, const float*, const T*,
                        const int64_t*, int64_t, int64_t, float, float* const*);

template <typename T>
TileFn<T> tile_for(int64_t head_dim) {
  if (head_dim == 2 * kLanes) return &attend_tile<2, T>;
  if (head_dim == 4 * kLanes) return &attend_tile<4, T>;
  if (head_dim == 8 * kLanes) return &attend_tile<8, T>;
  return nullptr;
}

// The bf16 tile on float multiply-adds: every build, and the reference for the one below
namespace plain {
using Pair = simd::vpair;
using simd::pair_load;
using simd::pair_set1;
inline simd::vf dot2(simd::vf acc, Pair a, Pair b) {
  acc = simd::fma(simd::pair_high(a), simd::pair_high(b), acc);  // exact products: the
  return simd::fma(simd::pair_low(a), simd::pair_low(b), acc);   // same sums as vdpbf16ps
}
inline void round_pairs(simd::vf e, uint32_t* out) {
  simd::store(reinterpret_cast<c10::BFloat16*>(out), e);  // kLanes bf16: kLanes / 2 pairs
}
#include "prefill_bf16_tile.inc"
}  // namespace plain

#if defined(__AVX512F__)
// r[i] holds row i of a 16 x 16 matrix of 32-bit words; on return, column i
inline void transpose_words(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4a + c], 128-bit lane k: rows 4a..4a+3 of column 4k + c
  __m512i u[16];
  for (int a = 0; a < 16; a += 4) {
    u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i ab_low = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i ab_high = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i cd_low = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i cd_high = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(ab_low, cd_low, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(ab_low, cd_low, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(ab_high, cd_high, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(ab_high, cd_high, 0xDD);
  }
}

// A whole tile's keys into pair_keys_values' layout: each 32 dimensions of its 16 keys as
// 16 x 16 words (words(lane, g): key `lane`'s dimensions g..g+31 as 16 bf16 pairs),
// transposed
template <class Words>
inline void pair_key_tile(Words words, int64_t head_dim, uint32_t* keys_p) {
  for (int64_t g = 0; g < head_dim; g += 32) {
    __m512i rows[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) rows[lane] = words(lane, g);
    transpose_words(rows);
    for (int d = 0; d < kLanes; ++d) _mm512_storeu_si512(keys_p + (g / 2 + d) * kLanes, rows[d]);
  }
}
#endif

// The bf16 tile on AVX512-BF16's dot product, two products per lane per instruction: built
// into the AVX-512 kernels under that target, run only where the CPU has it
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define EMBER_BF16_DOT 1
#pragma GCC push_options
#pragma GCC target("avx512bf16")
namespace native {
using Pair = __m512i;
using simd::pair_load;
using simd::pair_set1;
inline simd::vf dot2(simd::vf acc, Pair a, Pair b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}
inline void round_pairs(simd::vf e, uint32_t* out) {
  const __m256bh pairs = _mm512_cvtneps_pbh(e);
  std::memcpy(out, &pairs, sizeof(pairs));
}
#include "prefill_bf16_tile.inc"

// 32 entries of a row from the cache as 16 words of bf16 pairs: a float32 cache's on
// AVX512-BF16's conversion, two vectors rounded and packed in one instruction (nearest
// even, as round_bf16; denormals go to zero, as the bf16 products take them anyway); a
// bf16 cache's as they are
inline __m512i bf16_words(const float* row) {
  const __m512bh pairs = _mm512_cvtne2ps_pbh(simd::load(row + kLanes), simd::load(row));
  return reinterpret_cast<const __m512i&>(pairs);
}
inline __m512i bf16_words(const c10::BFloat16* row) { return _mm512_loadu_si512(row); }

// pair_keys_values for a tile of kLanes tokens all in the context: the keys transposed as
// words, the values' token pairs interleaved
template <typename T>
void pair_whole_tile(const T* keys, const T* values, const int64_t* table, int64_t block_size,
                     int64_t token_stride, int64_t head_dim, int64_t tile, uint32_t* keys_p,
                     uint32_t* values_p) {
  int64_t offsets[kLanes];
  for (int lane = 0; lane < kLanes; ++lane)
    offsets[lane] = token_offset(table, tile * kLanes + lane, block_size, token_stride);
  pair_key_tile([&](int lane, int64_t g) { return bf16_words(keys + offsets[lane] + g); },
                head_dim, keys_p);
  // a word per entry: the entry of tokens 2j (low half) and 2j + 1, 32 entries at a time
  const __m512i first_16 = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i last_16 = _mm512_add_epi16(first_16, _mm512_set1_epi16(16));
  for (int j = 0; j < kLanes / 2; ++j) {
    const T* low = values + offsets[2 * j];
    const T* high = values + offsets[2 * j + 1];
    for (int64_t x = 0; x < head_dim; x += 32) {
      const __m512i a = bf16_words(low + x), b = bf16_words(high + x);
      _mm512_storeu_si512(values_p + j * head_dim + x, _mm512_permutex2var_epi16(a, first_16, b));
      _mm512_storeu_si512(values_p + j * head_dim + x + kLanes, _mm512_permutex2var_epi16(a, last_16, b));
    }
  }
}
}  // namespace native
#pragma GCC pop_options

// The bf16 attention on AMX tiles: built into the AVX-512 kernels under that target, run
// only where amx_supported()
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")
#include "prefill_amx_tile.inc"
#pragma GCC pop_options
#else
#define EMBER_BF16_DOT 0
#endif

}  // namespace

// Whether this build has the AMX kernel and may run it: the CPU has AMX-BF16 (CPUID leaf 7:
// EDX bits 22 and 24) and Linux lets this process use the tile state, which it must ask for
// once (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; refused on kernels before
// 5.16 or where the OS keeps it off).
bool amx_supported() {
#if EMBER_BF16_DOT
  static const bool granted = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
    if (!amx_bf16 || !amx_tile || !__builtin_cpu_supports("avx512bf16")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

// the head sizes the prefill kernels take: 2, 4 and 8 vectors
std::vector<int64_t> prefill_head_dims() { return {2 * kLanes, 4 * kLanes, 8 * kLanes}; }

bool bf16_dot_supported() {
#if EMBER_BF16_DOT
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

namespace {

// keys_p[tile][d / 2][lane]: key (tile * kLanes + lane), dimensions d and d + 1, as a bf16
// pair; values_p[tile][j][x]: tokens (tile * kLanes + 2j) and the next one, value entry x.
// Past the context both are zero.
template <typename T>
void pair_keys_values(const T* keys, const T* values, const int64_t* table,
                      int64_t context_len, int64_t block_size, int64_t token_stride,
                      int64_t head_dim, int64_t tile, uint32_t* keys_p, uint32_t* values_p) {
  const int64_t first = tile * kLanes, half_dim = head_dim / 2;
  auto slot = [&](int64_t t) { return token_offset(table, t, block_size, token_stride); };
  alignas(64) c10::BFloat16 row[8 * kLanes];  // one key in bf16: its pairs, in order
  const uint32_t* row_pairs = reinterpret_cast<const uint32_t*>(row);
  int scalar_lanes = kLanes;  // the keys paired one by one below
#if defined(__AVX512F__)
  if (first + kLanes <= context_len) {  // a whole tile: transposed (pair_key_tile)
    pair_key_tile(
        [&](int lane, int64_t g) {
          const T* key = keys + slot(first + lane) + g;
          const __m256i low = _mm512_cvtepi32_epi16(simd::round_bf16(simd::load(key)));
          const __m256i high = _mm512_cvtepi32_epi16(simd::round_bf16(simd::load(key + kLanes)));
          return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
        },
        head_dim, keys_p);
    scalar_lanes = 0;
  }
#endif
  for (int lane = 0; lane < scalar_lanes; ++lane) {
    const int64_t t = first + lane;
    if (t >= context_len) {
      for (int64_t d = 0; d < half_dim; ++d) keys_p[d * kLanes + lane] = 0;
      continue;
    }
    const T* key = keys + slot(t);  // a bf16 cache's values round to themselves
    for (int64_t x = 0; x < head_dim; x += kLanes) simd::store(row + x, simd::load(key + x));
    for (int64_t d = 0; d < half_dim; ++d) keys_p[d * kLanes + lane] = row_pairs[d];
  }
  for (int j = 0; j < kLanes / 2; ++j) {
    const int64_t t = first + 2 * j;
    uint32_t* out = values_p + j * head_dim;
    const T* low = t < context_len ? values + slot(t) : nullptr;
    const T* high = t + 1 < context_len ? values + slot(t + 1) : nullptr;
    for (int64_t x = 0; x < head_dim; x += kLanes)
      simd::pair_store(out + x, simd::bf16_pairs(low ? simd::load(low + x) : simd::zero(),
                                                 high ? simd::load(high + x) : simd::zero()));
  }
}

// What both entry points check and share: the chunk's shapes and its block table
struct Chunk {
  int64_t num_tokens, num_heads, head_dim, block_size, num_kv_heads, group, token_stride;
  int64_t num_key_tiles, rows_per_head, first_pos;
  at::Tensor table;
  const int64_t* table_ptr;
};

Chunk check_chunk(const at::Tensor& q, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_table,
                  int64_t context_len, c10::ScalarType q_dtype, const char* name) {
  TORCH_CHECK(q.dtype() == q_dtype, name, ": q in ", c10::toString(q_dtype));
  TORCH_CHECK(q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              name, ": contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              name, ": q [T, H, D], caches [blocks, block_size, kv_heads, D]");
  Chunk c;
  c.num_tokens = q.size(0), c.num_heads = q.size(1), c.head_dim = q.size(2);
  c.block_size = key_cache.size(1), c.num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == c.head_dim && c.num_heads % c.num_kv_heads == 0,
              name, ": head shapes");
  TORCH_CHECK(c.head_dim == 2 * kLanes || c.head_dim == 4 * kLanes || c.head_dim == 8 * kLanes,
              name, ": head_dim ", c.head_dim, " is not 2, 4 or 8 vectors of ", kLanes);
  c.table = block_table.to(at::kLong).contiguous();
  TORCH_CHECK(context_len >= c.num_tokens && c.num_tokens >= 1 &&
                  c.table.numel() * c.block_size >= context_len,
              name, ": context_len");
  c.table_ptr = c.table.data_ptr<int64_t>();
  for (int64_t b = 0; b < (context_len + c.block_size - 1) / c.block_size; ++b)
    TORCH_CHECK(c.table_ptr[b] >= 0 && c.table_ptr[b] < key_cache.size(0),
                name, ": block id out of range");
  c.group = c.num_heads / c.num_kv_heads;
  c.token_stride = c.num_kv_heads * c.head_dim;
  c.num_key_tiles = (context_len + kLanes - 1) / kLanes;
  c.rows_per_head = c.num_tokens * c.group;  // row = token * group + g
  c.first_pos = context_len - c.num_tokens;
  return c;
}

// Runs attend(head, row offsets, positions, rows) on every tile of Rows query rows, all
// KV heads, over the threads; a tile's unused rows get offset -1. Tiles come from both ends
// of the chunk in turn: later rows see more keys, and each thread's share of the work
// items then holds cheap and dear tiles alike (and a thread done with its share takes
// what is left of the others', work_chunks.h). Each thread calls begin() before its first
// tile and end() after its last.
template <int Rows = kRows, class Attend, class Begin = NoThreadHook, class End = NoThreadHook>
void for_each_tile(const Chunk& c, Attend attend, Begin begin_thread = {}, End end_thread = {}) {
  const int64_t tiles_per_head = (c.rows_per_head + Rows - 1) / Rows;
  parallel_chunks(
      c.num_kv_heads * tiles_per_head, 1,
      [&](int64_t begin, int64_t end) {
        int64_t offsets[Rows], pos[Rows];
        for (int64_t work = begin; work < end; ++work) {
          const int64_t head = work / tiles_per_head, turn = work % tiles_per_head;
          const int64_t tile = turn % 2 == 0 ? turn / 2 : tiles_per_head - 1 - turn / 2;
          const int64_t row0 = tile * Rows;
          const int num_rows = static_cast<int>(std::min<int64_t>(Rows, c.rows_per_head - row0));
          for (int r = 0; r < Rows; ++r) {
            const int64_t row = row0 + std::min(r, num_rows - 1), token = row / c.group;
            offsets[r] = r < num_rows ? (token * c.num_heads + head * c.group + row % c.group) * c.head_dim : -1;
            pos[r] = c.first_pos + token;
          }
          attend(head, offsets, pos, num_rows);
        }
      },
      begin_thread, end_thread);
}

}  // namespace

at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor key_cache,
                                   at::Tensor value_cache, at::Tensor block_table,
                                   int64_t context_len, double scale) {
  const Chunk c = check_chunk(q, key_cache, value_cache, block_table, context_len,
                              at::kFloat, "paged_prefill_attention");
  auto out = at::empty_like(q);
  with_cache_type(key_cache, value_cache, "paged_prefill_attention", [&](auto element) {
    using T = decltype(element);
    const TileFn<T> attend = tile_for<T>(c.head_dim);
    const int64_t tile_floats = c.head_dim * kLanes;
    std::vector<float> keys_t(c.num_kv_heads * c.num_key_tiles * tile_floats);
    const T* k_ptr = static_cast<const T*>(key_cache.data_ptr());
    const T* v_ptr = static_cast<const T*>(value_cache.data_ptr());
    parallel_chunks(c.num_kv_heads * c.num_key_tiles, 16, [&](int64_t begin, int64_t end) {
      for (int64_t work = begin; work < end; ++work) {
        const int64_t head = work / c.num_key_tiles, tile = work % c.num_key_tiles;
        transpose_keys(k_ptr + head * c.head_dim, c.table_ptr, context_len, c.block_size,
                       c.token_stride, c.head_dim, tile, keys_t.data() + work * tile_floats);
      }
    });

    const float* q_ptr = q.data_ptr<float>();
    float* out_ptr = out.data_ptr<float>();
    const float fscale = static_cast<float>(scale);
    std::vector<float> zero_row(c.head_dim, 0.f);
    for_each_tile(c, [&](int64_t head, const int64_t* offsets, const int64_t* pos, int num_rows) {
      const float* rows[kRows];  // padding rows read a zero row: computed, never stored
      float* outs[kRows];
      for (int r = 0; r < kRows; ++r) {
        rows[r] = offsets[r] >= 0 ? q_ptr + offsets[r] : zero_row.data();
        outs[r] = offsets[r] >= 0 ? out_ptr + offsets[r] : nullptr;
      }
      attend(rows, pos, num_rows, keys_t.data() + head * c.num_key_tiles * tile_floats,
             v_ptr + head * c.head_dim, c.table_ptr, c.block_size, c.token_stride, fscale, outs);
    });
  });
  return out;
}

namespace {

// Every KV head's keys and values as bf16 pairs (pair_keys_values), key_tiles tiles a head
// (past the context: zero)
struct PairedCache {
  std::unique_ptr<uint32_t[]> words;  // uninitialized: pair_keys_values writes every word
  uint32_t* keys;
  uint32_t* values;
  int64_t head_words;  // a KV head's words in either
};

PairedCache pair_cache(const Chunk& c, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, int64_t context_len,
                       int64_t key_tiles, const char* name) {
  const int64_t tile_words = c.head_dim / 2 * kLanes;  // a key tile, and a value tile
  const int64_t words = c.num_kv_heads * key_tiles * tile_words;
  PairedCache paired{std::unique_ptr<uint32_t[]>(new uint32_t[2 * words]), nullptr, nullptr,
                     key_tiles * tile_words};
  paired.keys = paired.words.get();
  paired.values = paired.keys + words;
  with_cache_type(key_cache, value_cache, name, [&](auto element) {
    using T = decltype(element);
    const T* k_ptr = static_cast<const T*>(key_cache.data_ptr());
    const T* v_ptr = static_cast<const T*>(value_cache.data_ptr());
#if EMBER_BF16_DOT
    static const bool convert = bf16_dot_supported();
#endif
    parallel_chunks(c.num_kv_heads * key_tiles, 16, [&](int64_t begin, int64_t end) {
      for (int64_t work = begin; work < end; ++work) {
        const int64_t head = work / key_tiles, tile = work % key_tiles;
#if EMBER_BF16_DOT
        if (convert && (tile + 1) * kLanes <= context_len) {
          native::pair_whole_tile(k_ptr + head * c.head_dim, v_ptr + head * c.head_dim,
                                  c.table_ptr, c.block_size, c.token_stride, c.head_dim, tile,
                                  paired.keys + work * tile_words, paired.values + work * tile_words);
          continue;
        }
#endif
        pair_keys_values(k_ptr + head * c.head_dim, v_ptr + head * c.head_dim, c.table_ptr,
                         context_len, c.block_size, c.token_stride, c.head_dim, tile,
                         paired.keys + work * tile_words, paired.values + work * tile_words);
      }
    });
  });
  return paired;
}

// Runs attend(rows, outs, first word of the KV head, num_rows) on tiles of Rows query rows
// of bf16 q, writing bf16 out
template <int Rows, class Attend, class Begin = NoThreadHook, class End = NoThreadHook>
void for_each_bf16_tile(const Chunk& c, const at::Tensor& q, at::Tensor& out,
                        int64_t head_words, Attend attend, Begin begin = {}, End end = {}) {
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* out_ptr = reinterpret_cast<c10::BFloat16*>(out.data_ptr<at::BFloat16>());
  std::vector<uint16_t> zero_row(c.head_dim, 0);
  for_each_tile<Rows>(
      c,
      [&](int64_t head, const int64_t* offsets, const int64_t* pos, int num_rows) {
        const uint16_t* rows[Rows];  // padding rows read a zero row: computed, never stored
        c10::BFloat16* outs[Rows];
        for (int r = 0; r < Rows; ++r) {
          rows[r] = offsets[r] >= 0 ? q_ptr + offsets[r] : zero_row.data();
          outs[r] = offsets[r] >= 0 ? out_ptr + offsets[r] : nullptr;
        }
        attend(rows, outs, pos, num_rows, head * head_words);
      },
      begin, end);
}

}  // namespace

// The same attention on bf16 q in bf16 products (keys, values and the softmax weights
// rounded to bf16; scores, softmax and sums in float32), bf16 out: `bf16_dot` on
// AVX512-BF16's dot product (bf16_dot_supported()), else on float multiply-adds that give
// the same sums.
at::Tensor paged_prefill_attention_bf16(at::Tensor q, at::Tensor key_cache,
                                        at::Tensor value_cache, at::Tensor block_table,
                                        int64_t context_len, double scale, bool bf16_dot) {
  const char* name = "paged_prefill_attention_bf16";
  const Chunk c = check_chunk(q, key_cache, value_cache, block_table, context_len,
                              at::kBFloat16, name);
  TORCH_CHECK(!bf16_dot || bf16_dot_supported(), name, ": this CPU or build has no bf16 dot product");
#if EMBER_BF16_DOT
  const auto attend = bf16_dot ? native::tile_bf16_for(c.head_dim) : plain::tile_bf16_for(c.head_dim);
#else
  const auto attend = plain::tile_bf16_for(c.head_dim);
#endif
  const PairedCache paired = pair_cache(c, key_cache, value_cache, context_len, c.num_key_tiles, name);
  auto out = empty_padded_rows(q.size(0), q.size(1) * q.size(2), q.options()).view(q.sizes());
  const float fscale = static_cast<float>(scale);
  for_each_bf16_tile<kRows>(c, q, out, paired.head_words,
                            [&](const uint16_t* const* rows, c10::BFloat16* const* outs,
                                const int64_t* pos, int num_rows, int64_t first_word) {
                              const uint32_t* pairs[kRows];  // a row's bf16 values read as pairs
                              for (int r = 0; r < kRows; ++r)
                                pairs[r] = reinterpret_cast<const uint32_t*>(rows[r]);
                              attend(pairs, pos, num_rows,
                                     paired.keys + first_word,
                                     paired.values + first_word, fscale, outs);
                            });
  return out;
}

// The same attention (bf16 q, keys, values and weights; float32 scores, softmax and sums)
// on AMX tiles, where amx_supported(): the products summed in another order than the
// kernel above, so the results differ from it by float32 rounding.
at::Tensor paged_prefill_attention_amx(at::Tensor q, at::Tensor key_cache,
                                       at::Tensor value_cache, at::Tensor block_table,
                                       int64_t context_len, double scale) {
  const char* name = "paged_prefill_attention_amx";
  const Chunk c = check_chunk(q, key_cache, value_cache, block_table, context_len,
                              at::kBFloat16, name);
  TORCH_CHECK(amx_supported(), name, ": this CPU or build has no AMX tiles");
  TORCH_CHECK(scale > 0, name, ": scale must be positive");
#if EMBER_BF16_DOT
  using amx::kBlockTiles;
  const auto attend = amx::rows_for(c.head_dim);
  TORCH_CHECK(attend != nullptr && c.head_dim % 32 == 0, name, ": head_dim ", c.head_dim);
  const int64_t key_tiles = (c.num_key_tiles + kBlockTiles - 1) / kBlockTiles * kBlockTiles;
  const PairedCache paired = pair_cache(c, key_cache, value_cache, context_len, key_tiles, name);
  auto out = empty_padded_rows(q.size(0), q.size(1) * q.size(2), q.options()).view(q.sizes());
  const float fscale = static_cast<float>(scale);
  for_each_bf16_tile<amx::kAmxRows>(
      c, q, out, paired.head_words,
      [&](const uint16_t* const* rows, c10::BFloat16* const* outs, const int64_t* pos,
          int num_rows, int64_t first_word) {
        attend(rows, pos, num_rows, paired.keys + first_word,
               paired.values + first_word, fscale, outs);
      },
      [] { amx::configure_tiles(); }, [] { amx::release_tiles(); });
  return out;
#else
  return at::Tensor();
#endif
}
