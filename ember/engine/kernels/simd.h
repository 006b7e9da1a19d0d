// The vector operations ember's kernels are written in, for the instruction set this
// copy of the kernels is compiled for. The kernels are built once per ISA, each with its
// own flags (ember/engine/kernels/__init__.py: x86-64-v4 for AVX-512, x86-64-v3 for
// AVX2+FMA+F16C, the compiler's baseline for `generic`), and the one the CPU runs is
// picked at run time; nothing here may assume more than its own block's macros promise.
//
//   AVX-512   16 lanes, __m512, SLEEF's 16-lane expf (torch exports it)
//   AVX2       8 lanes, __m256, SLEEF's 8-lane AVX2 expf
//   generic    8 lanes, the compiler's vector extensions (SSE2 on x86-64, NEON on ARM)
//
// `vpair` holds kLanes pairs of bf16 (two per 32-bit lane, the low half first, as AVX512-BF16
// pairs them); pair_low / pair_high widen either half to float32, exactly.
//
// A kernel written against `vf` with kLanes-wide chunks, one accumulator per output and
// k in order, computes the same sums on every path up to the fused multiply-add: AVX-512
// and AVX2 fuse, the generic path fuses only where its target has an FMA instruction.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>  // torch's copy; libtorch_cpu exports the functions
#endif

namespace simd {

// How far ahead of the block being multiplied int8_tiles.cpp asks for its weights
// (prefetch, below): on a 2-core Xeon the default model's decode matmuls streamed their
// 62 MB in 1.7-2.0 ms a token with it, 3.7-3.9 ms without (2 KB ahead: 2.9-3.3; 8 KB:
// 1.8-2.2). A prefetch of an unmapped address is dropped, never a fault, so a stream
// may ask past its end.
constexpr int64_t kPrefetchAhead = 16384;

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr int kLanes = 16;
using vf = __m512;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float v) { return _mm512_set1_ps(v); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
// bf16 is the top half of a float32: widen each 16-bit lane and shift it up
inline vf load(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline vf exp(vf v) { return Sleef_expf16_u10(v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
// 2^t for t below 128 (0 for -inf and far below): 2^(t - floor t) on a degree-4
// polynomial fitted for relative error over [0, 1) (within 2.7e-6, as a degree-5 Taylor
// series), then scaled by 2^floor(t), which scalef takes from t itself. Six operations
// (the series with its rounding, clamp and ln 2 took ten): the AMX prefill attention's
// softmax and bf16 silu_and_mul take it.
inline vf exp2_bounded(vf t) {
  const vf f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // t - floor t
  vf p = _mm512_fmadd_ps(_mm512_set1_ps(0.013534151f), f, _mm512_set1_ps(0.052011490f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24144274f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69300383f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026f));
  return _mm512_scalef_ps(p, t);
}
// 1 / x to within 2^-22 or so: the 14-bit estimate and a Newton step (a division's
// throughput is a few times that on a zmm register)
inline vf reciprocal(vf x) {
  const vf r = _mm512_rcp14_ps(x);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.f)));
}

// kLanes pairs of bf16, a pair per 32-bit lane (the low half first), and each half
// widened to float32
using vpair = __m512i;
inline vpair pair_load(const uint32_t* p) { return _mm512_loadu_si512(p); }
inline vpair pair_set1(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
inline vf pair_low(vpair v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline vf pair_high(vpair v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void pair_store(uint32_t* p, vpair v) { _mm512_storeu_si512(p, v); }
// each lane rounded to bf16 (nearest even; a NaN stays a NaN), in the lane's low 16 bits:
// integer ops, no AVX512-BF16 needed
inline vpair round_bf16(vf v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
}
inline vpair bf16_pairs(vf low, vf high) {
  return _mm512_or_si512(round_bf16(low), _mm512_slli_epi32(round_bf16(high), 16));
}
inline void store(c10::BFloat16* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bf16(v)));
}

// kLanes bytes -> kLanes floats: unsigned, signed, low and high nibbles
inline __m512i bytes_u(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vf from_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(bytes_u(p)); }
inline vf from_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf low_nibbles(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(bytes_u(p), _mm512_set1_epi32(0x0F)));
}
inline vf high_nibbles(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes_u(p), 4));
}
// both of the above from one load
inline void nibbles(const uint8_t* p, vf& low, vf& high) {
  const __m512i q = bytes_u(p);
  low = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)));
  high = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
}
// kLanes bytes -> kLanes floats of the bit field (byte >> shift) & mask
inline vf bits(const uint8_t* p, int shift, int mask) {
  const __m512i q = _mm512_srl_epi32(bytes_u(p), _mm_cvtsi32_si128(shift));
  return _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(mask)));
}
// one bit per lane: lane i = (word >> (first + i)) & 1
inline vf word_bits(uint32_t word, int first) {
  const __m512i shifts = _mm512_add_epi32(
      _mm512_set1_epi32(first), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i q = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts);
  return _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(1)));
}

#elif defined(__AVX2__)
constexpr const char* kIsa = "avx2";
constexpr int kLanes = 8;
using vf = __m256;

inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float v) { return _mm256_set1_ps(v); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce_add(vf v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
inline vf exp(vf v) { return Sleef_expf8_u10avx2(v); }
// 2^t for t below 128 (0 for -inf and far below), the AVX-512 build's polynomial on
// t - floor t; 2^floor t made from its exponent bits in two halves (each a normal float
// down to 2^-95: a result below 2^-126 is rounded once, as scalef rounds it; a NaN t
// gives a finite value, as a caller's NaN operand carries the NaN on)
inline vf exp2_bounded(vf t) {
  t = _mm256_max_ps(t, _mm256_set1_ps(-190.f));  // 2^-190 rounds to 0 as well
  const vf whole = _mm256_floor_ps(t), f = _mm256_sub_ps(t, whole);
  vf p = _mm256_fmadd_ps(_mm256_set1_ps(0.013534151f), f, _mm256_set1_ps(0.052011490f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24144274f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.69300383f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000026f));
  const __m256i n = _mm256_cvtps_epi32(whole), half = _mm256_srai_epi32(n, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const vf a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const vf b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(n, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}
// 1 / x to within 2^-21 or so: the 12-bit estimate and a Newton step
inline vf reciprocal(vf x) {
  const vf r = _mm256_rcp_ps(x);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(x, r, _mm256_set1_ps(2.f)));
}
inline float reduce_max(vf v) {
  const __m128 quad = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_max_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
}

using vpair = __m256i;
inline vpair pair_load(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vpair pair_set1(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
inline vf pair_low(vpair v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline vf pair_high(vpair v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void pair_store(uint32_t* p, vpair v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline vpair round_bf16(vf v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}
inline vpair bf16_pairs(vf low, vf high) {
  return _mm256_or_si256(round_bf16(low), _mm256_slli_epi32(round_bf16(high), 16));
}
inline void store(c10::BFloat16* p, vf v) {
  const __m256i rounded = round_bf16(v);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

inline __m256i bytes_u(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vf from_u8(const uint8_t* p) { return _mm256_cvtepi32_ps(bytes_u(p)); }
inline vf from_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf low_nibbles(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(bytes_u(p), _mm256_set1_epi32(0x0F)));
}
inline vf high_nibbles(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes_u(p), 4));
}
inline void nibbles(const uint8_t* p, vf& low, vf& high) {
  const __m256i q = bytes_u(p);
  low = _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0F)));
  high = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
}
inline vf bits(const uint8_t* p, int shift, int mask) {
  const __m256i q = _mm256_srl_epi32(bytes_u(p), _mm_cvtsi32_si128(shift));
  return _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(mask)));
}
inline vf word_bits(uint32_t word, int first) {
  const __m256i shifts = _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i q = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts);
  return _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(1)));
}

#else
constexpr const char* kIsa = "generic";
constexpr int kLanes = 8;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vf zero() { return vf{}; }
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// Widening in this build is written as interleaves of 16-byte registers (SSE2's punpck,
// NEON's zip): GCC 12 made __builtin_convertvector from bytes, and shuffles of vectors
// wider than a register, one lane at a time.
typedef uint8_t vbytes16 __attribute__((vector_size(16)));
typedef uint16_t vhalves8 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));
typedef float vf4 __attribute__((vector_size(16)));
inline vf join(vf4 low, vf4 high) { return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7); }
// (vf{} + v, and a 16-byte broadcast joined, went through memory where a kernel's lambda
// took the vector by reference: 8 scalar stores, then wider loads)
static_assert(kLanes == 8, "set1 and pair_set1 list the lanes");
inline vf set1(float v) { return vf{v, v, v, v, v, v, v, v}; }
inline vf load(const c10::BFloat16* p) {  // each bf16 the high half of a float32
  vhalves8 h;
  std::memcpy(&h, p, sizeof(h));
  const vhalves8 z = {};
  return join(reinterpret_cast<vf4>(__builtin_shufflevector(z, h, 0, 8, 1, 9, 2, 10, 3, 11)),
              reinterpret_cast<vf4>(__builtin_shufflevector(z, h, 4, 12, 5, 13, 6, 14, 7, 15)));
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf add(vf a, vf b) { return a + b; }
inline vf sub(vf a, vf b) { return a - b; }
inline vf mul(vf a, vf b) { return a * b; }
inline vf div(vf a, vf b) { return a / b; }
inline vf fma(vf a, vf b, vf c) { return a * b + c; }
inline float reduce_add(vf v) {  // pairwise, as the x86 paths reduce
  float four[4];
  for (int i = 0; i < 4; ++i) four[i] = v[i] + v[i + 4];
  return (four[0] + four[2]) + (four[1] + four[3]);
}
inline vf exp(vf v) {
  for (int i = 0; i < kLanes; ++i) v[i] = std::exp(v[i]);
  return v;
}
inline float reduce_max(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::fmax(m, v[i]);
  return m;
}

typedef uint32_t vpair __attribute__((vector_size(kLanes * sizeof(uint32_t))));
inline vpair pair_load(const uint32_t* p) {
  vpair v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vpair pair_set1(uint32_t v) { return vpair{v, v, v, v, v, v, v, v}; }
inline vf pair_low(vpair v) {
  const vpair bits = v << 16;
  vf f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline vf pair_high(vpair v) {
  const vpair bits = v & 0xFFFF0000u;
  vf f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void pair_store(uint32_t* p, vpair v) { std::memcpy(p, &v, sizeof(v)); }
inline vpair round_bf16(vf v) {
  vpair out;
  for (int i = 0; i < kLanes; ++i) out[i] = c10::BFloat16(v[i]).x;
  return out;
}
inline vpair bf16_pairs(vf low, vf high) { return round_bf16(low) | round_bf16(high) << 16; }
inline void store(c10::BFloat16* p, vf v) {
  for (int i = 0; i < kLanes; ++i) p[i] = c10::BFloat16(v[i]);
}

inline vbytes16 bytes(const uint8_t* p) {  // p[0..7] in the low half
  typedef uint64_t v2 __attribute__((vector_size(16)));
  uint64_t eight;
  std::memcpy(&eight, p, sizeof(eight));
  return reinterpret_cast<vbytes16>(v2{eight, 0});
}
// bytes 0-7 of b as floats (b[i] unsigned; with `is_signed`, int8)
inline vf bytes_float(vbytes16 b, bool is_signed = false) {
  const vbytes16 zero = {};
  // each byte beside a zero (unsigned) or beside itself (its sign, after a shift)
  const vbytes16 fill = is_signed ? b : zero;
  const vhalves8 h = reinterpret_cast<vhalves8>(
      __builtin_shufflevector(b, fill, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
  const vhalves8 hfill = is_signed ? h : reinterpret_cast<vhalves8>(zero);
  vi4 low = reinterpret_cast<vi4>(__builtin_shufflevector(h, hfill, 0, 8, 1, 9, 2, 10, 3, 11));
  vi4 high = reinterpret_cast<vi4>(__builtin_shufflevector(h, hfill, 4, 12, 5, 13, 6, 14, 7, 15));
  if (is_signed) {
    low >>= 24;
    high >>= 24;
  }
  return join(__builtin_convertvector(low, vf4), __builtin_convertvector(high, vf4));
}
inline vf from_u8(const uint8_t* p) { return bytes_float(bytes(p)); }
inline vf from_i8(const int8_t* p) { return bytes_float(bytes(reinterpret_cast<const uint8_t*>(p)), true); }
inline vf low_nibbles(const uint8_t* p) { return bytes_float(bytes(p) & 0x0F); }
inline vf high_nibbles(const uint8_t* p) { return bytes_float(bytes(p) >> 4); }
inline void nibbles(const uint8_t* p, vf& low, vf& high) {
  const vbytes16 q = bytes(p);
  low = bytes_float(q & 0x0F);
  high = bytes_float(q >> 4);
}
inline vf bits(const uint8_t* p, int shift, int mask) {
  return bytes_float((bytes(p) >> shift) & static_cast<uint8_t>(mask));
}
inline vf word_bits(uint32_t word, int first) {
  const int32_t shifted = static_cast<int32_t>(word >> first);
  const vi4 w = {shifted, shifted, shifted, shifted};
  return join(__builtin_convertvector((w >> vi4{0, 1, 2, 3}) & 1, vf4),
              __builtin_convertvector((w >> vi4{4, 5, 6, 7}) & 1, vf4));
}
#endif

// An fp16 field of a quantized block (its scale or minimum), as float32.
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#elif defined(__aarch64__)  // the CPU's own conversion
  __fp16 half;
  std::memcpy(&half, &bits, sizeof(half));
  return half;
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// 32 bytes of small integer codes (a 32-weight group of a quantized block, as unsigned
// bytes) and their products with 32 int8 activations (the int8 block GEMM). On x86 these
// are AVX2's 256-bit integer ops, in the AVX-512 build as well; elsewhere plain vectors.
#if defined(__AVX2__)
using vcodes = __m256i;
inline vcodes codes_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// the low nibbles of 16 bytes, then their high nibbles
inline vcodes codes_nibbles(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}
// (p[i] >> shift) & mask for 32 bytes
inline vcodes codes_bits(const uint8_t* p, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(codes_load(p), _mm_cvtsi32_si128(shift)),
                          _mm256_set1_epi8(static_cast<char>(mask)));
}
// byte i: `value` where bit i of word is set, else 0
inline vcodes codes_word_bits(uint32_t word, int value) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(word)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(static_cast<char>(value)));
}
inline float codes_sum(__m256 v) {  // the 8 lanes' sum, pairwise
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
inline vcodes codes_or(vcodes a, vcodes b) { return _mm256_or_si256(a, b); }
inline vcodes codes_shl4(vcodes a) { return _mm256_slli_epi16(a, 4); }  // bytes below 16 only

// 8 sums of 4 products code * x each (the 32 in order: sums 0-3 are the first 16), as
// floats; `code` unsigned below 64 (pairs stay within int16), or with `is_signed` int8
// codes, whose signs move onto x
inline __m256 codes_dot(vcodes code, const int8_t* x, bool is_signed) {
  __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  if (is_signed) {
    xv = _mm256_sign_epi8(xv, code);
    code = _mm256_sign_epi8(code, code);
  }
  const __m256i pairs = _mm256_maddubs_epi16(code, xv);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// The K-quants' integer products (a group's, exact in int32): `vscale` is a group's
// sub-block scales as int16, one for weights 0-15 and one for 16-31; scaled_dot gives sum
// code_i * x_i * scale_i over the 32 in 8 int32 lanes (4 products each). code_i < 64
// keeps each pair of products within int16 (maddubs), and |scale| <= 128 each lane
// within 2^22.
using vsums = __m256i;
using vscale = __m256i;
inline vscale scale_same(int s) { return _mm256_set1_epi16(static_cast<int16_t>(s)); }
// the 16 int8 scales of a super-block (Q6_K), widened; scale_pair(all, g) is g's two
using vscales16 = __m256i;
inline vscales16 scales16_load(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vscale scale_pair(vscales16 all, int g) {
  // dword g holds scales 2g, 2g+1: spread it, then the low lane repeats the first, the
  // high lane the second
  const __m256i pair = _mm256_permutevar8x32_epi32(all, _mm256_set1_epi32(g));
  return _mm256_shuffle_epi8(pair, _mm256_set_epi64x(0x0302030203020302, 0x0302030203020302,
                                                     0x0100010001000100, 0x0100010001000100));
}
inline vsums scaled_dot(vcodes code, const int8_t* x, vscale scale) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(code, xv), scale);
}
// lane i: a_2i b_2i + a_2i+1 b_2i+1, over 16 int16 pairs
inline vsums pairs_dot16(vscales16 a, const int16_t* b) {
  return _mm256_madd_epi16(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
}
// lane i: a_i
inline vsums bytes_widen8(const uint8_t* a) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)));
}
inline __m256 sums_float(vsums a) { return _mm256_cvtepi32_ps(a); }
#else
typedef uint8_t vcodes __attribute__((vector_size(32)));
typedef int16_t vcodes16 __attribute__((vector_size(64)));
inline vcodes codes_load(const uint8_t* p) {
  vcodes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vcodes codes_nibbles(const uint8_t* p) {
  vcodes v;
  for (int i = 0; i < 16; ++i) {
    v[i] = p[i] & 0x0F;
    v[16 + i] = p[i] >> 4;
  }
  return v;
}
inline vcodes codes_bits(const uint8_t* p, int shift, int mask) {
  return (codes_load(p) >> shift) & static_cast<uint8_t>(mask);
}
inline vcodes codes_word_bits(uint32_t word, int value) {
  vcodes v;
  for (int i = 0; i < 32; ++i) v[i] = (word >> i) & 1 ? value : 0;
  return v;
}
inline vcodes codes_or(vcodes a, vcodes b) { return a | b; }
inline vcodes codes_shl4(vcodes a) { return a << 4; }

// The K-quants' integer products, as in the AVX2 block (the same exact int32 sums)
typedef int32_t vsums __attribute__((vector_size(32)));
struct vscale {
  int16_t half[2];
};
struct vscales16 {
  int16_t s[16];
};
inline vscale scale_same(int s) { return {{static_cast<int16_t>(s), static_cast<int16_t>(s)}}; }
inline vscales16 scales16_load(const int8_t* p) {
  vscales16 out;
  for (int i = 0; i < 16; ++i) out.s[i] = p[i];
  return out;
}
inline vscale scale_pair(const vscales16& all, int g) { return {{all.s[2 * g], all.s[2 * g + 1]}}; }
inline vsums scaled_dot(vcodes code, const int8_t* x, vscale scale) {
  vsums out{};
  for (int i = 0; i < 32; ++i) out[i / 4] += code[i] * static_cast<int32_t>(x[i]) * scale.half[i / 16];
  return out;
}
inline vsums pairs_dot16(const vscales16& a, const int16_t* b) {
  vsums out{};
  for (int i = 0; i < 16; ++i) out[i / 2] += a.s[i] * static_cast<int32_t>(b[i]);
  return out;
}
inline vsums bytes_widen8(const uint8_t* a) {
  vsums out;
  for (int i = 0; i < 8; ++i) out[i] = a[i];
  return out;
}
#endif

// ---- int8 tiles (int8_tiles.cpp) ---------------------------------------------------
// `vtile`: kLanes 32-bit lanes, lane j four bytes of output feature j's codes (or four
// int8 values of x, the same in every lane), and the integer sums made of them.
#if defined(__AVX512F__)
using vtile = __m512i;
inline vtile tile_zero() { return _mm512_setzero_si512(); }
inline vtile tile_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vtile tile_set4(const int8_t* p) {  // p[0..3] in every lane
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}
inline vtile tile_low4(vtile v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline vtile tile_high4(vtile v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
// int16 pairs u_2i s_2i + u_2i+1 s_2i+1 (u unsigned, s signed; saturating, so the callers
// keep |u| <= 128, |s| <= 127)
inline vtile tile_pairs(vtile u, vtile s) { return _mm512_maddubs_epi16(u, s); }
inline vtile tile_add16(vtile a, vtile b) { return _mm512_add_epi16(a, b); }
// v is kept where it is: GCC may not regroup a chain of adds across it (see int8_tiles.inc)
inline void tile_keep(vtile& v) { asm("" : "+v"(v)); }
inline vtile tile_add32(vtile a, vtile b) { return _mm512_add_epi32(a, b); }
inline vtile tile_quads(vtile pairs) { return _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)); }
inline vtile tile_abs8(vtile v) { return _mm512_abs_epi8(v); }
// x negated where w < 0 (where w = 0, |w| makes the product 0 whatever x is)
inline vtile tile_sign8(vtile x, vtile w) {
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
inline vf tile_float(vtile v) { return _mm512_cvtepi32_ps(v); }
// byte c of each lane in all four of its bytes
inline vtile tile_spread_byte(vtile v, int c) {
  const __m512i first = _mm512_broadcast_i32x4(_mm_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0));
  return _mm512_shuffle_epi8(v, _mm512_add_epi8(first, _mm512_set1_epi8(static_cast<char>(c))));
}
// codes (below 16) plus 16 in each byte whose bit of `pattern` (per lane) is set in spread
inline vtile tile_fifth_bit(vtile codes, vtile spread, uint32_t pattern) {
  const __mmask64 set = _mm512_test_epi8_mask(spread, _mm512_set1_epi32(static_cast<int>(pattern)));
  return _mm512_mask_add_epi8(codes, set, codes, _mm512_set1_epi8(0x10));
}
inline vf abs(vf v) { return _mm512_abs_ps(v); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
// v rounded to nearest (ties to even, as std::nearbyint) into kLanes int8 at out, v
// within [-127.5, 127.5]; returns their sum
inline int round_to_int8(vf v, int8_t* out) {
  const __m512i q = _mm512_cvtps_epi32(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q));
  return _mm512_reduce_add_epi32(q);
}
inline vf halves_load(const uint8_t* p) {  // kLanes fp16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#elif defined(__AVX2__)
using vtile = __m256i;
inline vtile tile_zero() { return _mm256_setzero_si256(); }
inline vtile tile_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vtile tile_set4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}
inline vtile tile_low4(vtile v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline vtile tile_high4(vtile v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
inline vtile tile_pairs(vtile u, vtile s) { return _mm256_maddubs_epi16(u, s); }
inline vtile tile_add16(vtile a, vtile b) { return _mm256_add_epi16(a, b); }
inline void tile_keep(vtile& v) { asm("" : "+x"(v)); }  // as in the AVX-512 build
inline vtile tile_add32(vtile a, vtile b) { return _mm256_add_epi32(a, b); }
inline vtile tile_quads(vtile pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
inline vtile tile_abs8(vtile v) { return _mm256_abs_epi8(v); }
inline vtile tile_sign8(vtile x, vtile w) { return _mm256_sign_epi8(x, w); }
inline vf tile_float(vtile v) { return _mm256_cvtepi32_ps(v); }
inline vtile tile_spread_byte(vtile v, int c) {
  const __m256i first = _mm256_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C,
                                         0x08080808, 0x04040404, 0);
  return _mm256_shuffle_epi8(v, _mm256_add_epi8(first, _mm256_set1_epi8(static_cast<char>(c))));
}
inline vtile tile_fifth_bit(vtile codes, vtile spread, uint32_t pattern) {
  const __m256i bit = _mm256_set1_epi32(static_cast<int>(pattern));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(codes, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}
inline vf abs(vf v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline int round_to_int8(vf v, int8_t* out) {
  const __m256i q = _mm256_cvtps_epi32(v);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(words, words));
  const __m128i pairs = _mm_madd_epi16(words, _mm_set1_epi16(1));  // 4 sums of 2
  const __m128i two = _mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 0xB1)));
}
inline vf halves_load(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
// The generic build's tiles (int8_tiles.inc), in 16-byte vectors (an SSE2 or a NEON
// register): word c of kLanes features' codes (32 bytes, feature j's four at 4j..4j+3)
// widened to four vectors of 8 int16 (two features' four each); x's four values of that
// word, the same in each feature's four; their products summed in int16 while that is
// exact, then each feature's four into int32 (tile16_quads)
typedef int16_t vword __attribute__((vector_size(16)));
struct vtile16 {
  vword part[4];
};
// 8 bytes widened to int16, each byte twice and the pair read as one int16 (the byte's
// value in its high half): compilers make this one zip of the register (GCC 12 made
// __builtin_convertvector's widening one lane at a time on ARM)
inline vword bytes_twice(const uint8_t* p) {
  typedef uint8_t v8 __attribute__((vector_size(8)));
  v8 b;
  std::memcpy(&b, p, sizeof(b));
  return reinterpret_cast<vword>(
      __builtin_shufflevector(b, b, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
}
inline vtile16 tile16_load(const uint8_t* p) {  // unsigned codes
  typedef uint16_t vwordu __attribute__((vector_size(16)));
  vtile16 out;
  for (int k = 0; k < 4; ++k)
    out.part[k] = reinterpret_cast<vword>(reinterpret_cast<vwordu>(bytes_twice(p + 8 * k)) >> 8);
  return out;
}
inline vtile16 tile16_load_signed(const uint8_t* p) {  // int8 codes
  vtile16 out;
  for (int k = 0; k < 4; ++k) out.part[k] = bytes_twice(p + 8 * k) >> 8;
  return out;
}
inline vword tile16_set4(const int8_t* q) {  // q[0..3] in each feature's four
  uint8_t eight[8];
  std::memcpy(eight, q, 4);
  std::memcpy(eight + 4, q, 4);
  return bytes_twice(eight) >> 8;
}
// The same words' sums in int32, two per feature: feature 2k's two, then 2k+1's, in part k
typedef int32_t vquad __attribute__((vector_size(16)));
struct vtile32 {
  vquad part[4];
};
inline vtile32 tile16_pairs(const vtile16& v) {
  typedef uint32_t v4u __attribute__((vector_size(16)));
  vtile32 out;
  for (int k = 0; k < 4; ++k) {
    const vquad low = reinterpret_cast<vquad>(reinterpret_cast<v4u>(v.part[k]) << 16) >> 16;
    out.part[k] = low + (reinterpret_cast<vquad>(v.part[k]) >> 16);
  }
  return out;
}
inline void tile32_add(vtile32& a, const vtile32& b) {
  for (int k = 0; k < 4; ++k) a.part[k] += b.part[k];
}
// lane j: the sum of feature j's two
inline vi tile32_quads(const vtile32& v) {
  const vquad first = __builtin_shufflevector(v.part[0], v.part[1], 0, 2, 4, 6) +
                      __builtin_shufflevector(v.part[0], v.part[1], 1, 3, 5, 7);
  const vquad second = __builtin_shufflevector(v.part[2], v.part[3], 0, 2, 4, 6) +
                       __builtin_shufflevector(v.part[2], v.part[3], 1, 3, 5, 7);
  return __builtin_shufflevector(first, second, 0, 1, 2, 3, 4, 5, 6, 7);
}
// lane j: the sum of feature j's four int16 (exact)
inline vi tile16_quads(const vtile16& v) { return tile32_quads(tile16_pairs(v)); }
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "tile16_pairs reads int16 pairs as int32");
// codes plus 16 where the fifth bit is set: feature j's element i takes bit 8c + shift + i
// of j's word (words: kLanes 4-byte words)
inline void tile16_fifth_bit(vtile16& codes, const uint8_t* words, int c, int shift) {
  vi w;
  std::memcpy(&w, words, sizeof(w));
  const int f = 8 * c + shift;
  const vi bit = {f, f + 1, f + 2, f + 3, f, f + 1, f + 2, f + 3};
  const vi spreads[4] = {__builtin_shufflevector(w, w, 0, 0, 0, 0, 1, 1, 1, 1),
                         __builtin_shufflevector(w, w, 2, 2, 2, 2, 3, 3, 3, 3),
                         __builtin_shufflevector(w, w, 4, 4, 4, 4, 5, 5, 5, 5),
                         __builtin_shufflevector(w, w, 6, 6, 6, 6, 7, 7, 7, 7)};
  for (int k = 0; k < 4; ++k)
    codes.part[k] |= __builtin_convertvector((spreads[k] >> bit) & 1, vword) << 4;
}

inline vf abs(vf v) {
  for (int i = 0; i < kLanes; ++i) v[i] = std::fabs(v[i]);
  return v;
}
inline vf max(vf a, vf b) {
  for (int i = 0; i < kLanes; ++i) a[i] = std::fmax(a[i], b[i]);
  return a;
}
inline int round_to_int8(vf v, int8_t* out) {
  int sum = 0;
  for (int i = 0; i < kLanes; ++i) {
    out[i] = static_cast<int8_t>(std::nearbyint(v[i]));
    sum += out[i];
  }
  return sum;
}
#endif

}  // namespace simd
