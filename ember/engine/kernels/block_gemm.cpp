// y = x W^T for a few rows of float32 x, W kept as the GGUF file's quantized blocks
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: 32 weights per block; the K-quants Q4_K, Q5_K, Q6_K:
// 256 per super-block), on whichever vector ISA this build is for (simd.h).
//
// The fp32 weights ember loads from such a file are exactly what these blocks decode to:
// every weight is a small integer code times a scale, where the scale (an fp16 d, or for
// the K-quants d times a 6- or 8-bit sub-block scale) times the code is exact in fp32,
// so the only rounding is the one subtraction or addition of the minimum, which a fused
// multiply-add rounds the way the loader's `d * q - m` does (gguf's dequantizers; see
// each format below). Decoding in registers therefore reproduces the fp32 weights bit
// for bit, while a decode step streams 0.56-1.06 bytes per weight instead of 4.
// The arithmetic is small_gemm.cpp's, in the same order (one vector of k at a time, M x R
// register accumulators, one reduction at the end), so the results are bit-identical
// to small_gemm on the dequantized weights.
//
// Layouts (d, m, dmin: fp16; 4-bit q: low nibbles hold a group's first weights, high
// nibbles the next; qh: the fifth (and sixth) bits):
//   Q4_0   18 bytes  [d | 16 bytes q]                  w = d * (q - 8)
//   Q4_1   20 bytes  [d | m | 16 bytes q]              w = d * q + m
//   Q5_0   22 bytes  [d | qh: u32 | 16 bytes q]        w = d * (q - 16)
//   Q5_1   24 bytes  [d | m | qh: u32 | 16 bytes q]    w = d * q + m
//   Q8_0   34 bytes  [d | 32 int8 q]                   w = q * d
//   Q4_K  144 bytes  [d | dmin | 12 bytes of 6-bit sc, mn for 8 sub-blocks | 128 bytes q]
//                                                      w = (d * sc) * q - dmin * mn
//   Q5_K  176 bytes  [d | dmin | 12 bytes sc, mn | 32 bytes qh | 128 bytes q]   the same
//   Q6_K  210 bytes  [128 bytes low 4 bits | 64 bytes high 2 bits | 16 int8 sc | d]
//                                                      w = (d * sc) * (q - 32), sc per 16
// W is [out_features, blocks per row, bytes per block] uint8; the block size names the
// format.
#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "int8_rows.h"
#include "simd.h"
#include "work_chunks.h"

namespace {

using int8_rows::QuantizedRows;
using int8_rows::quantize_rows;
using simd::kLanes;
using simd::vf;

// Every format is decoded 32 weights (a group) at a time: a K-quant super-block is 8
// groups, each with its own scale (and minimum).
constexpr int kGroupWeights = 32;
constexpr int kChunks = kGroupWeights / kLanes;  // vectors per group
constexpr int kMaxRows = 8;  // rows of x per pass over W (register accumulators)

// Each format decodes group g of one block into its kChunks vectors of weights, in order,
// given the block's Scales, which `scales(block)` reads once per block (the 32-weight
// formats read their one scale as they decode). The 4-bit formats keep weights 0-15 in the low nibbles of their 16 bytes, 16-31 in the
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

// A 32-weight block's weights for the int8 path (`codes`): w = scale * code + min, the
// codes as unsigned bytes (Q8_0: its signed bytes, min 0). The K-quants take the int8
// path a super-block at a time instead (`int_codes`, below).
struct GroupScale {
  float scale, min;
};

struct OneGroup {  // a 32-weight block
  static constexpr int64_t kWeights = 32;
  static constexpr bool kSigned = false;  // codes are int8 (Q8_0)
  struct Scales {};
  static inline Scales scales(const uint8_t*) { return {}; }
};

struct Q4_0 : OneGroup {
  static constexpr int64_t kBytes = 18;
  static inline void decode(const uint8_t* block, Scales, int, vf* out) {
    const vf d = simd::set1(simd::half_at(block)), eight = simd::set1(8.f);
    nibble_halves(block + 2, out, [&](vf q) { return simd::mul(d, simd::sub(q, eight)); });
  }
  static inline simd::vcodes codes(const uint8_t* block, GroupScale& h) {
    const float d = simd::half_at(block);
    h = {d, -8.f * d};
    return simd::codes_nibbles(block + 2);
  }
};

struct Q4_1 : OneGroup {
  static constexpr int64_t kBytes = 20;
  static inline void decode(const uint8_t* block, Scales, int, vf* out) {
    const vf d = simd::set1(simd::half_at(block)), m = simd::set1(simd::half_at(block + 2));
    // d * q is exact: one rounding, fused or not
    nibble_halves(block + 4, out, [&](vf q) { return simd::fma(q, d, m); });
  }
  static inline simd::vcodes codes(const uint8_t* block, GroupScale& h) {
    h = {simd::half_at(block), simd::half_at(block + 2)};
    return simd::codes_nibbles(block + 4);
  }
};

// Q5_0 / Q5_1: 5-bit codes, the low nibble as in Q4_0, bit i of the u32 qh above weight i's
inline vf five_bits(const uint8_t* qh, const uint8_t* qs, int c) {
  uint32_t high;
  std::memcpy(&high, qh, sizeof(high));
  const int first = c * kLanes;  // the chunk's first weight: nibbles of byte first % 16
  const vf low = simd::bits(qs + first % 16, 4 * (first / 16), 0x0F);
  return simd::fma(simd::word_bits(high, first), simd::set1(16.f), low);  // exact
}

inline simd::vcodes five_bit_codes(const uint8_t* qh, const uint8_t* qs) {
  uint32_t high;
  std::memcpy(&high, qh, sizeof(high));
  return simd::codes_or(simd::codes_nibbles(qs), simd::codes_word_bits(high, 16));
}

struct Q5_0 : OneGroup {
  static constexpr int64_t kBytes = 22;
  static inline void decode(const uint8_t* block, Scales, int, vf* out) {
    const vf d = simd::set1(simd::half_at(block)), sixteen = simd::set1(16.f);
    for (int c = 0; c < kChunks; ++c)
      out[c] = simd::mul(d, simd::sub(five_bits(block + 2, block + 6, c), sixteen));
  }
  static inline simd::vcodes codes(const uint8_t* block, GroupScale& h) {
    const float d = simd::half_at(block);
    h = {d, -16.f * d};
    return five_bit_codes(block + 2, block + 6);
  }
};

struct Q5_1 : OneGroup {
  static constexpr int64_t kBytes = 24;
  static inline void decode(const uint8_t* block, Scales, int, vf* out) {
    const vf d = simd::set1(simd::half_at(block)), m = simd::set1(simd::half_at(block + 2));
    for (int c = 0; c < kChunks; ++c) out[c] = simd::fma(five_bits(block + 4, block + 8, c), d, m);
  }
  static inline simd::vcodes codes(const uint8_t* block, GroupScale& h) {
    h = {simd::half_at(block), simd::half_at(block + 2)};
    return five_bit_codes(block + 4, block + 8);
  }
};

struct Q8_0 : OneGroup {
  static constexpr int64_t kBytes = 34;
  static constexpr bool kSigned = true;
  static inline simd::vcodes codes(const uint8_t* block, GroupScale& h) {
    h = {simd::half_at(block), 0.f};
    return simd::codes_load(block + 2);
  }
  static inline void decode(const uint8_t* block, Scales, int, vf* out) {
    const vf d = simd::set1(simd::half_at(block));
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int c = 0; c < kChunks; ++c) out[c] = simd::mul(simd::from_i8(q + c * kLanes), d);
  }
};

// The int8 path's accumulator of one output: 8 lanes of scaled integer sums, and the
// minima's share (see the int8 section below)
#if defined(__AVX2__)
struct Int8Acc {
  __m256 sums = _mm256_setzero_ps();
  float mins = 0.f;
  float total() const { return simd::codes_sum(sums) + mins; }
  void add(simd::vsums v, float scale) {  // sums += v * scale
    sums = _mm256_fmadd_ps(simd::sums_float(v), _mm256_set1_ps(scale), sums);
  }
  void add_lanes(simd::vsums v, const float* scales, float factor) {  // lane i: scales[i] * factor
    const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(scales), _mm256_set1_ps(factor));
    sums = _mm256_fmadd_ps(simd::sums_float(v), scale, sums);
  }
};
#else
struct Int8Acc {
  float sums = 0.f, mins = 0.f;
  float total() const { return sums + mins; }
  void add(simd::vsums v, float scale) {
    int64_t total = 0;
    for (int i = 0; i < 8; ++i) total += v[i];
    sums += static_cast<float>(total) * scale;
  }
  void add_lanes(simd::vsums v, const float* scales, float factor) {
    for (int i = 0; i < 8; ++i) sums += static_cast<float>(v[i]) * (scales[i] * factor);
  }
};
#endif

// What a K-quant super-block's products need of x beside its int8 values: its 8 groups'
// dx and dx * (sum of q over the group), and q summed over each 16
struct XBlock {
  const float *scale, *group_sums;
  const int16_t* sums16;
};

// Q4_K / Q5_K: each group's scale d * sc and minimum dmin * mn, both exact in fp32 (an
// fp16 times a 6-bit integer); block bytes 4-15 pack the 6-bit sc, mn of the 8 groups
// (ggml's get_scale_min_k4), counting from byte 4:
//   bytes 0-3:  sc of groups 0-3 (bits 0-5), top 2 bits of sc of groups 4-7
//   bytes 4-7:  mn of groups 0-3 (bits 0-5), top 2 bits of mn of groups 4-7
//   bytes 8-11: low 4 bits of sc (bits 0-3) and of mn (bits 4-7) of groups 4-7
struct KScales {
  float scale[8], minus_min[8];
};

inline KScales k_scales(const uint8_t* block) {
  const float d = simd::half_at(block), dmin = simd::half_at(block + 2);
  const uint8_t* s = block + 4;
  KScales out;
  for (int g = 0; g < 4; ++g) {
    out.scale[g] = d * static_cast<float>(s[g] & 63);
    out.minus_min[g] = -(dmin * static_cast<float>(s[g + 4] & 63));
    out.scale[g + 4] = d * static_cast<float>((s[g + 8] & 0x0F) | ((s[g] >> 6) << 4));
    out.minus_min[g + 4] = -(dmin * static_cast<float>((s[g + 8] >> 4) | ((s[g + 4] >> 6) << 4)));
  }
  return out;
}

// The same 6-bit sc, mn as bytes, with d and dmin (the int8 path's super-block sums):
// four groups' fields at a time, from the three 32-bit words of bytes 4-15
struct KIntScales {
  float d, dmin;
  uint8_t sc[8], mn[8];
};

inline KIntScales k_int_scales(const uint8_t* block) {
  uint32_t word[3];
  std::memcpy(word, block + 4, sizeof(word));
  const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, low2 = 0x03030303;
  const uint32_t sc[2] = {word[0] & low6, (word[2] & low4) | (((word[0] >> 6) & low2) << 4)};
  const uint32_t mn[2] = {word[1] & low6, ((word[2] >> 4) & low4) | (((word[1] >> 6) & low2) << 4)};
  KIntScales out;
  out.d = simd::half_at(block);
  out.dmin = simd::half_at(block + 2);
  std::memcpy(out.sc, sc, sizeof(sc));
  std::memcpy(out.mn, mn, sizeof(mn));
  return out;
}

// Q4_K's 128 bytes of q: groups 2i and 2i+1 are the low and high nibbles of bytes 32i..
struct KQuant {
  static constexpr int64_t kWeights = 256;
  static constexpr bool kSigned = false;
  using IntScales = KIntScales;
  static inline IntScales int_scales(const uint8_t* block) { return k_int_scales(block); }
  static inline simd::vscale group_scale(const IntScales& s, int g) { return simd::scale_same(s.sc[g]); }
  static inline float d(const IntScales& s) { return s.d; }
  // - dmin sum_g mn_g dx_g (sum of q over group g): lane g of the 8
  static inline void minimum(Int8Acc& acc, const IntScales& s, const XBlock& x) {
    acc.add_lanes(simd::bytes_widen8(s.mn), x.group_sums, -s.dmin);
  }
};

struct Q4_K : KQuant {
  static constexpr int64_t kBytes = 144;
  using Scales = KScales;
  static inline Scales scales(const uint8_t* block) { return k_scales(block); }
  static inline void decode(const uint8_t* block, const Scales& s, int g, vf* out) {
    const vf scale = simd::set1(s.scale[g]), minus_min = simd::set1(s.minus_min[g]);
    const uint8_t* q = block + 16 + 32 * (g / 2);
    for (int c = 0; c < kChunks; ++c)  // (d * sc) * q exact: one rounding, as gguf's
      out[c] = simd::fma(simd::bits(q + c * kLanes, 4 * (g % 2), 0x0F), scale, minus_min);
  }
  static inline simd::vcodes int_codes(const uint8_t* block, int g) {
    return simd::codes_bits(block + 16 + 32 * (g / 2), 4 * (g % 2), 0x0F);
  }
};

// Q5_K: Q4_K's nibbles, with bit g of qh byte i the fifth bit of group g's weight i
struct Q5_K : KQuant {
  static constexpr int64_t kBytes = 176;
  using Scales = KScales;
  static inline Scales scales(const uint8_t* block) { return k_scales(block); }
  static inline void decode(const uint8_t* block, const Scales& s, int g, vf* out) {
    const vf scale = simd::set1(s.scale[g]), minus_min = simd::set1(s.minus_min[g]);
    const uint8_t *qh = block + 16, *q = block + 48 + 32 * (g / 2);
    for (int c = 0; c < kChunks; ++c) {
      const vf low = simd::bits(q + c * kLanes, 4 * (g % 2), 0x0F);
      const vf code = simd::fma(simd::bits(qh + c * kLanes, g, 1), simd::set1(16.f), low);
      out[c] = simd::fma(code, scale, minus_min);
    }
  }
  static inline simd::vcodes int_codes(const uint8_t* block, int g) {
    const simd::vcodes low = simd::codes_bits(block + 48 + 32 * (g / 2), 4 * (g % 2), 0x0F);
    return simd::codes_or(low, simd::codes_shl4(simd::codes_bits(block + 16, g, 1)));
  }
};

// Q6_K: two halves of 128 weights; in half h, group t (0-3) takes the low or high nibbles
// (t / 2) of low-bit bytes 64h + 32 (t % 2).., and bits 2t, 2t+1 of high-bit bytes 32h..;
// one int8 scale per 16 weights. d * sc * q < 2^11 * 2^7 * 2^6 units of d's last bit:
// exact in fp32, and so is d * sc * (q - 32), gguf's product: one fused multiply-add of
// q by d * sc less 32 d * sc gives it exactly.
struct Q6_K {
  static constexpr int64_t kBytes = 210, kWeights = 256;
  static constexpr bool kSigned = false;
  struct Scales {
    float scale[16], minus_32_scale[16];  // d * sc, one per 16 weights; -32 d * sc
  };
  static inline Scales scales(const uint8_t* block) {
    const float d = simd::half_at(block + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    Scales out;
    for (int i = 0; i < 16; ++i) {
      out.scale[i] = d * static_cast<float>(sc[i]);
      out.minus_32_scale[i] = -32.f * out.scale[i];
    }
    return out;
  }
  static inline void decode(const uint8_t* block, const Scales& s, int g, vf* out) {
    const int h = g / 4, t = g % 4;
    const uint8_t *low = block + 64 * h + 32 * (t % 2), *high = block + 128 + 32 * h;
    for (int c = 0; c < kChunks; ++c) {
      const vf code = simd::fma(simd::bits(high + c * kLanes, 2 * t, 3), simd::set1(16.f),
                                simd::bits(low + c * kLanes, 4 * (t / 2), 0x0F));
      const int i = 2 * g + c * kLanes / 16;
      out[c] = simd::fma(code, simd::set1(s.scale[i]), simd::set1(s.minus_32_scale[i]));
    }
  }
  struct IntScales {
    float d;
    simd::vscales16 sc;
  };
  static inline IntScales int_scales(const uint8_t* block) {
    return {simd::half_at(block + 208), simd::scales16_load(reinterpret_cast<const int8_t*>(block + 192))};
  }
  static inline simd::vscale group_scale(const IntScales& s, int g) { return simd::scale_pair(s.sc, g); }
  static inline float d(const IntScales& s) { return s.d; }
  // - 32 d sum_g dx_g (sc_2g qsum_2g + sc_2g+1 qsum_2g+1), qsum_j the sum of q over
  // sub-block j: lane g of the 8
  static inline void minimum(Int8Acc& acc, const IntScales& s, const XBlock& x) {
    acc.add_lanes(simd::pairs_dot16(s.sc, x.sums16), x.scale, -32.f * s.d);
  }
  static inline simd::vcodes int_codes(const uint8_t* block, int g) {
    const int half = g / 4, t = g % 4;
    const simd::vcodes low = simd::codes_bits(block + 64 * half + 32 * (t % 2), 4 * (t / 2), 0x0F);
    return simd::codes_or(low, simd::codes_shl4(simd::codes_bits(block + 128 + 32 * half, 2 * t, 3)));
  }
};

// Calls fn(F{}) for the format whose blocks are `block_bytes` long; false if none is.
template <typename Fn>
bool with_format(int64_t block_bytes, const Fn& fn) {
  switch (block_bytes) {
    case Q4_0::kBytes: fn(Q4_0{}); return true;
    case Q4_1::kBytes: fn(Q4_1{}); return true;
    case Q5_0::kBytes: fn(Q5_0{}); return true;
    case Q5_1::kBytes: fn(Q5_1{}); return true;
    case Q8_0::kBytes: fn(Q8_0{}); return true;
    case Q4_K::kBytes: fn(Q4_K{}); return true;
    case Q5_K::kBytes: fn(Q5_K{}); return true;
    case Q6_K::kBytes: fn(Q6_K{}); return true;
    default: return false;
  }
}

// R rows of W against M rows of x, as in small_gemm.cpp: the R rows' blocks are decoded
// once into registers and used for every row of x. M x R accumulators, R x kChunks
// decoded vectors and kChunks of x must fit in the registers (32 with AVX-512, 16
// otherwise), which sets R for each M.
template <int M>
constexpr int rows_per_group() {
  if (kLanes == 16) return M <= 4 ? 4 : 2;
  return M <= 2 ? 2 : 1;
}

// Walks R rows of W (from w0) block by block, calling fn(b, scales) with each block
// column's scales, read once per row. The next group's rows follow these: they are
// prefetched, spread over the walk.
template <int R, typename F, typename S = typename F::Scales, typename Read = S (*)(const uint8_t*),
          typename Fn>
inline void walk_blocks(const uint8_t* w0, int64_t row_bytes, int64_t k_dim, Read read, const Fn& fn) {
  const char* ahead = reinterpret_cast<const char*>(w0 + R * row_bytes);
  constexpr int64_t ahead_step = R * F::kBytes;  // bytes of W one block step reads
  for (int64_t b = 0; b < k_dim / F::kWeights; ++b) {
    for (int64_t o = 0; o < ahead_step; o += 64) simd::prefetch(ahead + o);
    simd::prefetch(ahead + ahead_step - 1);
    ahead += ahead_step;
    S scales[R];
    for (int r = 0; r < R; ++r) scales[r] = read(w0 + r * row_bytes + b * F::kBytes);
    fn(b, scales);
  }
}

template <int M, int R, typename F>
void row_group(const float* x, const uint8_t* w, float* y, int64_t k_dim, int64_t n_dim,
               int64_t row_bytes, int64_t j) {
  vf acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = simd::zero();
  const uint8_t* w0 = w + j * row_bytes;
  walk_blocks<R, F>(w0, row_bytes, k_dim, F::scales, [&](int64_t b, const typename F::Scales* scales) {
    for (int g = 0; g < F::kWeights / kGroupWeights; ++g) {
      vf weights[R][kChunks];
      for (int r = 0; r < R; ++r)
        F::decode(w0 + r * row_bytes + b * F::kBytes, scales[r], g, weights[r]);
      const float* xg = x + b * F::kWeights + g * kGroupWeights;
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < kChunks; ++c) {
          const vf xv = simd::load(xg + m * k_dim + c * kLanes);
          for (int r = 0; r < R; ++r) acc[m][r] = simd::fma(xv, weights[r][c], acc[m][r]);
        }
    }
  });
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_dim + j + r] = simd::reduce_add(acc[m][r]);
}

template <int M, typename F>
void block_gemm_m(const float* x, const uint8_t* w, float* y, int64_t k_dim, int64_t n_dim,
                  int64_t row_bytes) {
  constexpr int R = rows_per_group<M>();
  parallel_chunks(n_dim / R, 64 / R, [&](int64_t begin, int64_t end) {
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
  const int64_t row_bytes = k_dim / F::kWeights * F::kBytes;
  // more rows than the registers hold: one pass over W per group of kMaxRows
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows)
    block_gemm_rows<F>(std::min<int64_t>(kMaxRows, rows - m0), x + m0 * k_dim, w,
                       y + m0 * n_dim, k_dim, n_dim, row_bytes);
}

// ---- int8 activations -------------------------------------------------------------
// The int8 path (`block_gemm_int8`) quantizes each row of x to int8 per 32 values
// (int8_rows.h). With w = scale * code + min for a 32-weight block,
//   sum_i w_i x_i ~ scale * dx * sum code_i q_i  +  min * dx * sum q_i,
// where each sum of code_i q_i is an exact integer (AVX2's maddubs + madd, also in the
// AVX-512 build), turned to float once per 8 products. Not bit-identical to the fp32
// path: rounding x to 8 bits is its error (at most dx / 2 a value).

// acc += the block's products (`code`, `h`) with x's group (q, its dx and dx * sum of q)
template <typename F>
inline void int8_group(Int8Acc& acc, simd::vcodes code, const GroupScale& h, const int8_t* q,
                       float dx, float group_sum) {
#if defined(__AVX2__)
  acc.sums = _mm256_fmadd_ps(simd::codes_dot(code, q, F::kSigned), _mm256_set1_ps(h.scale * dx), acc.sums);
#else
  int32_t sum = 0;
  for (int i = 0; i < kGroupWeights; ++i)
    sum += (F::kSigned ? static_cast<int8_t>(code[i]) : code[i]) * static_cast<int32_t>(q[i]);
  acc.sums += (h.scale * dx) * static_cast<float>(sum);
#endif
  if (!F::kSigned) acc.mins += h.min * group_sum;
}

// R rows of W against M rows of x: each block's codes are decoded once for the M rows
template <int M, int R, typename F>
void int8_row_group(const QuantizedRows& x, const uint8_t* w, float* y, int64_t k_dim,
                    int64_t n_dim, int64_t row_bytes, int64_t j) {
  Int8Acc acc[M][R];
  const uint8_t* w0 = w + j * row_bytes;
  const int64_t x_groups = k_dim / kGroupWeights;
  walk_blocks<R, F>(w0, row_bytes, k_dim, F::scales, [&](int64_t b, const typename F::Scales*) {
    for (int r = 0; r < R; ++r) {
      GroupScale h;
      const simd::vcodes code = F::codes(w0 + r * row_bytes + b * F::kBytes, h);
      for (int m = 0; m < M; ++m)
        int8_group<F>(acc[m][r], code, h, x.q.data() + (m * x_groups + b) * kGroupWeights,
                      x.scale[m * x_groups + b], x.group_sums[m * x_groups + b]);
    }
  });
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_dim + j + r] = acc[m][r].total();
}

// ---- int8 activations on K-quant super-blocks ------------------------------------
// x is quantized per 32 values as above. A K-quant group's products with x's group sum
// exactly in int32 with its integer sub-block scales applied (maddubs, then madd with
// the scales: sc_j sum code_i q_i over each 16), turned to float once per group with
// d * dx; the minima once per super-block, a lane per group:
//   Q6_K       sum w x ~ sum_g d dx_g (sum_j sc_j (code . q)_j  -  32 sum_j sc_j qsum_j)
//   Q4_K/Q5_K  sum w x ~ sum_g d dx_g sc_g (code . q)_g  -  dmin sum_g mn_g dx_g qsum_g
// (j: the group's two sub-blocks of 16 weights (Q6_K), qsum: q summed over them).

// R rows of W against M rows of x, a super-block at a time: each group's codes are
// decoded once for the M rows
template <int M, int R, typename F>
void int8_super_row_group(const QuantizedRows& x, const uint8_t* w, float* y, int64_t k_dim,
                          int64_t n_dim, int64_t row_bytes, int64_t j) {
  Int8Acc acc[M][R];
  const uint8_t* w0 = w + j * row_bytes;
  constexpr int kGroups = F::kWeights / kGroupWeights;
  const int64_t x_groups = k_dim / kGroupWeights;
  walk_blocks<R, F, typename F::IntScales>(
      w0, row_bytes, k_dim, F::int_scales, [&](int64_t b, const typename F::IntScales* scales) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* block = w0 + r * row_bytes + b * F::kBytes;
          const float d = F::d(scales[r]);
          for (int g = 0; g < kGroups; ++g) {
            const simd::vcodes code = F::int_codes(block, g);
            const simd::vscale scale = F::group_scale(scales[r], g);
            for (int m = 0; m < M; ++m) {
              const int64_t xg = m * x_groups + b * kGroups + g;  // x's group
              acc[m][r].add(simd::scaled_dot(code, x.q.data() + xg * kGroupWeights, scale),
                            d * x.scale[xg]);
            }
          }
          for (int m = 0; m < M; ++m) {
            const int64_t xg = m * x_groups + b * kGroups;
            F::minimum(acc[m][r], scales[r],
                       {x.scale.data() + xg, x.group_sums.data() + xg, x.sums16.data() + 2 * xg});
          }
        }
      });
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_dim + j + r] = acc[m][r].total();
}

template <int M, typename F, typename X>
void int8_gemm_m(const X& x, const uint8_t* w, float* y, int64_t k_dim, int64_t n_dim,
                 int64_t row_bytes) {
  constexpr int R = M <= 2 ? 4 : 2;
  parallel_chunks(n_dim / R, 64 / R, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      if constexpr (F::kWeights == 256)
        int8_super_row_group<M, R, F>(x, w, y, k_dim, n_dim, row_bytes, g * R);
      else
        int8_row_group<M, R, F>(x, w, y, k_dim, n_dim, row_bytes, g * R);
    }
  });
}

template <typename F>
void int8_gemm_all(int64_t rows, const float* x, const uint8_t* w, float* y, int64_t k_dim,
                   int64_t n_dim) {
  const int64_t row_bytes = k_dim / F::kWeights * F::kBytes;
  constexpr int64_t kPass = 4;  // rows of x per pass over W
  for (int64_t m0 = 0; m0 < rows; m0 += kPass) {
    const int64_t m = std::min(kPass, rows - m0);
    const float* xm = x + m0 * k_dim;
    float* ym = y + m0 * n_dim;
    const auto run = [&](const auto& xq) {
      switch (m) {
        case 1: int8_gemm_m<1, F>(xq, w, ym, k_dim, n_dim, row_bytes); break;
        case 2: int8_gemm_m<2, F>(xq, w, ym, k_dim, n_dim, row_bytes); break;
        case 3: int8_gemm_m<3, F>(xq, w, ym, k_dim, n_dim, row_bytes); break;
        default: int8_gemm_m<4, F>(xq, w, ym, k_dim, n_dim, row_bytes); break;
      }
    };
    run(quantize_rows(xm, m, k_dim));
  }
}

}  // namespace

// Weights per block of the format with `block_bytes`-byte blocks; 0 for no such format.
int64_t block_weights(int64_t block_bytes) {
  int64_t weights = 0;
  with_format(block_bytes, [&](auto format) { weights = decltype(format)::kWeights; });
  return weights;
}

bool block_gemm_supported(int64_t in_features, int64_t out_features, int64_t block_bytes) {
  const int64_t weights = block_weights(block_bytes);
  return weights > 0 && in_features % weights == 0 && out_features % 4 == 0;
}

// x W^T (+ b) for `name` (block_gemm, block_gemm_int8) after checking its arguments:
// run(format, rows, x, w, y, k_dim, n_dim) computes the product for W's format.
template <typename Run>
at::Tensor blocks_product(const char* name, at::Tensor x, const at::Tensor& blocks,
                          const c10::optional<at::Tensor>& bias, const Run& run) {
  TORCH_CHECK(x.dtype() == at::kFloat && blocks.dtype() == at::kByte,
              name, ": float32 x, uint8 blocks");
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 3, name, ": 2-D x, 3-D blocks [out, blocks, bytes]");
  x = x.contiguous();
  TORCH_CHECK(blocks.is_contiguous(), name, ": contiguous blocks");
  const int64_t rows = x.size(0), k_dim = x.size(1), n_dim = blocks.size(0);
  const int64_t block_bytes = blocks.size(2), weights = block_weights(block_bytes);
  TORCH_CHECK(weights > 0, name, ": ", block_bytes, "-byte blocks are none of Q4_0, Q4_1, ",
              "Q5_0, Q5_1, Q8_0 (32 weights), Q4_K, Q5_K, Q6_K (256 weights)");
  TORCH_CHECK(rows >= 1 && block_gemm_supported(k_dim, n_dim, block_bytes),
              name, ": in_features % ", weights, " == 0, out_features % 4 == 0");
  TORCH_CHECK(blocks.size(1) * weights == k_dim, name, ": ", blocks.size(1), " blocks of ",
              weights, " weights per row, for ", k_dim, " in_features");
  auto y = at::empty({rows, n_dim}, x.options());
  with_format(block_bytes, [&](auto format) {
    run(format, rows, x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), y.data_ptr<float>(),
        k_dim, n_dim);
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// The float32 weights [rows, blocks per row * weights per block] that `blocks` ([rows,
// blocks per row, bytes per block] uint8) decode to: gguf's dequantizers' values bit for
// bit (see the top of this file), decoded a group at a time as the GEMMs do.
at::Tensor dequantize_blocks(const at::Tensor& blocks, bool bf16) {
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 3 && blocks.is_contiguous(),
              "dequantize_blocks: contiguous 3-D uint8 blocks [rows, blocks, bytes]");
  const int64_t rows = blocks.size(0), per_row = blocks.size(1), block_bytes = blocks.size(2);
  const int64_t weights = block_weights(block_bytes);
  TORCH_CHECK(weights > 0, "dequantize_blocks: ", block_bytes, "-byte blocks are none of "
              "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K");
  auto out = at::empty({rows, per_row * weights}, bf16 ? at::kBFloat16 : at::kFloat);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  // float32 as decoded, or each rounded to bf16 as torch rounds (nearest even): the packed
  // bf16 copy made without a float32 matrix between
  auto decode_to = [&](auto* dst) {
    with_format(block_bytes, [&](auto format) {
      using F = decltype(format);
      parallel_chunks(rows * per_row, 64, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const uint8_t* block = src + b * F::kBytes;
          const typename F::Scales scales = F::scales(block);
          for (int g = 0; g < F::kWeights / kGroupWeights; ++g) {
            vf group[kChunks];
            F::decode(block, scales, g, group);
            for (int c = 0; c < kChunks; ++c)
              simd::store(dst + b * F::kWeights + g * kGroupWeights + c * kLanes, group[c]);
          }
        }
      });
    });
  };
  if (bf16)
    decode_to(reinterpret_cast<c10::BFloat16*>(out.data_ptr<at::BFloat16>()));
  else
    decode_to(out.data_ptr<float>());
  return out;
}

// blocks: [out_features, blocks per row, bytes per block] uint8; the block size names the
// format.
at::Tensor block_gemm(at::Tensor x, at::Tensor blocks, c10::optional<at::Tensor> bias) {
  return blocks_product("block_gemm", x, blocks, bias, [](auto format, auto... args) {
    block_gemm_all<decltype(format)>(args...);
  });
}


// The same product with x's rows quantized to int8 (see the int8 section above); 4-D
// blocks are Q4_0 / Q4_1 / Q8_0 blocks in tiles of 16 features (int8_tiles.cpp).
at::Tensor block_gemm_int8(at::Tensor x, at::Tensor blocks, c10::optional<at::Tensor> bias) {
  if (blocks.dim() == 4) return tiled_gemm_int8(x, blocks, bias, true);
  return blocks_product("block_gemm_int8", x, blocks, bias, [](auto format, auto... args) {
    int8_gemm_all<decltype(format)>(args...);
  });
}
