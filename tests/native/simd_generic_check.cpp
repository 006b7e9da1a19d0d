// The generic build's vector helpers (ember/engine/kernels/simd.h, compiled without any
// -m flag) against plain scalar arithmetic: the lowerings GCC picks for SSE2 and for NEON
// differ (interleaves, broadcasts, __fp16), so tests/test_cpu_kernels.py builds this for
// the host and, where a cross compiler and qemu are installed, for aarch64.
#include "simd.h"
#include <cstdio>
#include <cstdlib>
int fails = 0;
#define CHECK(c) do { if (!(c)) { ++fails; std::printf("FAIL %s:%d %s\n", __FILE__, __LINE__, #c); } } while (0)
int main() {
  std::printf("isa %s\n", simd::kIsa);
  srand(1);
  uint8_t bytes[64]; for (auto& b : bytes) b = rand() & 255;
  for (int o = 0; o < 8; ++o) {
    simd::vf u = simd::from_u8(bytes + o), s = simd::from_i8(reinterpret_cast<int8_t*>(bytes + o));
    simd::vf lo = simd::low_nibbles(bytes + o), hi = simd::high_nibbles(bytes + o), l2, h2;
    simd::nibbles(bytes + o, l2, h2);
    simd::vf bt = simd::bits(bytes + o, 3, 7);
    for (int i = 0; i < 8; ++i) {
      CHECK(u[i] == bytes[o + i]); CHECK(s[i] == (int8_t)bytes[o + i]);
      CHECK(lo[i] == (bytes[o + i] & 15)); CHECK(hi[i] == (bytes[o + i] >> 4));
      CHECK(l2[i] == lo[i]); CHECK(h2[i] == hi[i]); CHECK(bt[i] == ((bytes[o + i] >> 3) & 7));
    }
  }
  uint32_t word = 0x9ABCDEF1u;
  for (int first = 0; first <= 24; first += 8) { simd::vf wb = simd::word_bits(word, first); for (int i = 0; i < 8; ++i) CHECK(wb[i] == ((word >> (first + i)) & 1)); }
  c10::BFloat16 bf[8]; for (int i = 0; i < 8; ++i) bf[i] = c10::BFloat16(i * 1.5f - 3.f);
  simd::vf l = simd::load(bf); for (int i = 0; i < 8; ++i) CHECK(l[i] == (float)bf[i]);
  simd::vf s1 = simd::set1(-2.5f); for (int i = 0; i < 8; ++i) CHECK(s1[i] == -2.5f);
  simd::vpair p1 = simd::pair_set1(0x12345678u); for (int i = 0; i < 8; ++i) CHECK(p1[i] == 0x12345678u);
  uint16_t h = 0x3E00; CHECK(simd::half_at(reinterpret_cast<uint8_t*>(&h)) == 1.5f);
  h = 0x0001; CHECK(simd::half_at(reinterpret_cast<uint8_t*>(&h)) == 5.9604644775390625e-08f);
  // tiles
  simd::vtile16 t = simd::tile16_load(bytes), ts = simd::tile16_load_signed(bytes);
  for (int k = 0; k < 4; ++k) for (int e = 0; e < 8; ++e) { CHECK(t.part[k][e] == bytes[8 * k + e]); CHECK(ts.part[k][e] == (int8_t)bytes[8 * k + e]); }
  int8_t q[4] = {-128, 127, -5, 9};
  simd::vword x4 = simd::tile16_set4(q); for (int e = 0; e < 8; ++e) CHECK(x4[e] == q[e % 4]);
  simd::vtile16 v; for (int k = 0; k < 4; ++k) for (int e = 0; e < 8; ++e) v.part[k][e] = (int16_t)(rand() % 60000 - 30000) / 4;
  simd::vi quads = simd::tile16_quads(v);
  for (int j = 0; j < 8; ++j) { int sum = 0; for (int i = 0; i < 4; ++i) sum += v.part[j / 2][(j % 2) * 4 + i]; CHECK(quads[j] == sum); }
  uint8_t words[32]; for (auto& b : words) b = rand() & 255;
  for (int c = 0; c < 4; ++c) for (int shift : {0, 4}) {
    simd::vtile16 codes = simd::tile16_load(bytes); for (int k = 0; k < 4; ++k) codes.part[k] &= 15;
    simd::vtile16 before = codes; simd::tile16_fifth_bit(codes, words, c, shift);
    for (int j = 0; j < 8; ++j) for (int i = 0; i < 4; ++i) {
      uint32_t w; std::memcpy(&w, words + 4 * j, 4);
      int expect = before.part[j / 2][(j % 2) * 4 + i] + (((w >> (8 * c + shift + i)) & 1) << 4);
      CHECK(codes.part[j / 2][(j % 2) * 4 + i] == expect);
    }
  }
  std::printf("%d failures\n", fails);
  return fails != 0;
}
