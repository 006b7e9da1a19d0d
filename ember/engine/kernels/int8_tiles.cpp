// y = x W^T on int8 activations for decode batches (1-16 rows of x), W as GGUF blocks of
// 32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) regrouped into tiles of 16 output features, so that each
// vector lane is one output feature: the integer sums of a block are made lane by lane
// and scaled lane by lane, with no reduction across lanes and no float work shared
// between rows of x. block_gemm.cpp's int8 path instead sums one feature's products
// across the lanes, then converts and scales them for every row of x: a row costs it
// about as much as the weights' decoding, so it paid for one row only on these formats.
// The idea is llama.cpp's row-interleaved ("repacked") blocks; the layout is ember's.
//
// Tiles (`ember.models.tiles.tile_blocks` makes them from [n, blocks, bytes] blocks):
// uint8 [n / 16, blocks per row, 16, bytes per block], each [16, bytes] the 16 features'
// blocks at one block column, the same bytes regrouped:
//   the 16 fp16 d (32 bytes); Q4_1 / Q5_1: then the 16 fp16 m (32 bytes);
//   Q5_0 / Q5_1: then the fifth bits, a 4-byte word per feature (64 bytes), its byte c
//     the fifth bits of weights 4c..4c+3 (bits 0-3) and 16+4c..16+4c+3 (bits 4-7);
//   then the codes as 4-byte words, word c of the 16 features together (64 bytes each):
//     Q4_0 / Q4_1 / Q5_0 / Q5_1: words 0-3, bytes 4c..4c+3 of the block's 16: their low
//       nibbles are weights 4c..4c+3, their high nibbles weights 16+4c..16+4c+3;
//     Q8_0: words 0-7, weights 4c..4c+3 (int8).
// x is quantized per 32 values (int8_rows.h: q, dx, dx * sum q). Per block, lane j sums
// code * q exactly in int32 (maddubs, then madd; Q8_0's signs move onto x), then
//   acc_j = fma(float(sum_j), d_j * dx, acc_j);   acc_j = fma(min_j, dx * sum q, acc_j)
// with min_j = -8 d_j (Q4_0), -16 d_j (Q5_0), m_j (Q4_1, Q5_1), none (Q8_0). The generic build
// makes the same integer sums in plain 16-byte vectors (int16 products, NEON's mla) and
// the float operations lane by lane (std::fma), so every build gives the same bits, and a
// row's result does not depend on the other rows of x.
#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "int8_rows.h"
#include "simd.h"
#include "work_chunks.h"

namespace {

using int8_rows::QuantizedRows;
using simd::kLanes;
using simd::vf;

constexpr int kTile = 16;   // output features per tile
constexpr int kGroup = 32;  // weights per block

enum class Min { kNone, kMinus8d, kMinus16d, kStored };
enum class Codes { kNibbles, kFiveBits, kInt8 };

template <int64_t Bytes, Codes C, Min M>
struct TileFormat {
  static constexpr int64_t kBytes = Bytes;  // per feature and block, as in the file
  static constexpr Codes kCodes = C;
  static constexpr Min kMin = M;
  static constexpr int kWords = C == Codes::kInt8 ? 8 : 4;  // 4-byte words of codes
  // where the fifth bits start (after d, and m), and the codes (after them)
  static constexpr int64_t kHighBits = (M == Min::kStored ? 4 : 2) * kTile;
  static constexpr int64_t kHeader = kHighBits + (C == Codes::kFiveBits ? 4 * kTile : 0);
};
using TQ4_0 = TileFormat<18, Codes::kNibbles, Min::kMinus8d>;
using TQ4_1 = TileFormat<20, Codes::kNibbles, Min::kStored>;
using TQ5_0 = TileFormat<22, Codes::kFiveBits, Min::kMinus16d>;
using TQ5_1 = TileFormat<24, Codes::kFiveBits, Min::kStored>;
using TQ8_0 = TileFormat<34, Codes::kInt8, Min::kNone>;

template <typename Fn>
bool with_tile_format(int64_t block_bytes, const Fn& fn) {
  switch (block_bytes) {
    case TQ4_0::kBytes: fn(TQ4_0{}); return true;
    case TQ4_1::kBytes: fn(TQ4_1{}); return true;
    case TQ5_0::kBytes: fn(TQ5_0{}); return true;
    case TQ5_1::kBytes: fn(TQ5_1{}); return true;
    case TQ8_0::kBytes: fn(TQ8_0{}); return true;
    default: return false;
  }
}

// x's rows, as one tile multiplies them: row m's int8 values, dx and dx * sum q per block
struct Rows {
  const int8_t* q;
  const float *scale, *sums;
  int64_t k_dim, groups;  // per row
};

#if defined(__AVX2__)
constexpr int kPass = kLanes == 16 ? 8 : 4;  // rows of x per pass over a tile (registers)
#else
constexpr int kPass = 4;  // a row's sums are 4 vectors: 16 of NEON's 32 registers
#endif

constexpr int64_t kRowBlock = 64;  // rows of x per pass over a thread's tiles (L2)

#define TILE_ROWS tile_rows
#include "int8_tiles.inc"
#undef TILE_ROWS

// The VNNI variant: the same sums on vpdpbusd where the CPU has it, picked at run time
// (the builds target x86-64-v4 / v3, which include neither VNNI): AVX512-VNNI in the
// AVX-512 build; AVX-VNNI (its VEX-encoded 256-bit form: Intel's cores from Alder Lake
// and Sapphire Rapids on, AMD's from Zen 5) in the AVX2 one.
#if defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__)  // GCC's target pragma
#pragma GCC push_options
#if defined(__AVX512F__)
#pragma GCC target("avx512vnni")
#define TILE_DPBUSD _mm512_dpbusd_epi32
#define TILES_VNNI_FEATURE "avx512vnni"
#else
#pragma GCC target("avxvnni")
#define TILE_DPBUSD _mm256_dpbusd_avx_epi32
#define TILES_VNNI_FEATURE "avxvnni"
#endif
#define TILES_VNNI
#define TILE_ROWS tile_rows_vnni
#include "int8_tiles.inc"
#undef TILE_ROWS
#undef TILES_VNNI
#undef TILE_DPBUSD
#pragma GCC pop_options
const bool kHasVnni = (__builtin_cpu_init(), __builtin_cpu_supports(TILES_VNNI_FEATURE));
const char* const kVnniName = TILES_VNNI_FEATURE;
#undef TILES_VNNI_FEATURE
#else
constexpr bool kHasVnni = false;
const char* const kVnniName = "";
template <typename F, int M>
void tile_rows_vnni(const Rows& x, const uint8_t* tile, int64_t blocks, float* y, int64_t n_dim) {
  tile_rows<F, M>(x, tile, blocks, y, n_dim);  // never called: no VNNI in this build
}
#endif

template <typename F, int M>
void rows_on_tile(bool vnni, const Rows& x, const uint8_t* tile, int64_t blocks, float* y, int64_t n_dim) {
  if (vnni)
    tile_rows_vnni<F, M>(x, tile, blocks, y, n_dim);
  else
    tile_rows<F, M>(x, tile, blocks, y, n_dim);
}

template <typename F>
void tiled_all(bool vnni, int64_t rows, const float* x, const uint8_t* tiles, float* y,
               int64_t k_dim, int64_t n_dim) {
  const QuantizedRows xq = int8_rows::quantize_rows(x, rows, k_dim);
  const int64_t blocks = k_dim / kGroup, tile_bytes = blocks * kTile * F::kBytes;
  // (row block, tile) pairs in row-block order: a thread's share and each chunk of it
  // go over one block of x's rows at a time (the block stays in L2)
  const int64_t n_tiles = n_dim / kTile, row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  parallel_chunks(row_blocks * n_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = item / n_tiles * kRowBlock, t = item % n_tiles;
      for (int64_t m0 = r0; m0 < std::min(r0 + kRowBlock, rows); m0 += kPass) {
        const Rows part{xq.q.data() + m0 * k_dim, xq.scale.data() + m0 * blocks,
                        xq.group_sums.data() + m0 * blocks, k_dim, blocks};
        const auto run = [&](auto rows_here) {
          rows_on_tile<F, decltype(rows_here)::value>(vnni, part, tiles + t * tile_bytes, blocks,
                                                      y + m0 * n_dim + t * kTile, n_dim);
        };
        switch (std::min<int64_t>(kPass, rows - m0)) {
          case 1: run(std::integral_constant<int, 1>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          case 4: run(std::integral_constant<int, 4>{}); break;
#if !defined(__AVX2__) || defined(__AVX512F__)
          case 5: run(std::integral_constant<int, 5>{}); break;
          case 6: run(std::integral_constant<int, 6>{}); break;
          case 7: run(std::integral_constant<int, 7>{}); break;
          case 8: run(std::integral_constant<int, 8>{}); break;
#endif
        }
      }
    }
  });
}

}  // namespace

bool tiles_use_vnni() { return kHasVnni; }

std::string tiles_vnni_name() { return kHasVnni ? kVnniName : ""; }

bool tiled_format(int64_t block_bytes) {
  return with_tile_format(block_bytes, [](auto) {});
}

// x W^T (+ b), W as tiles [n / 16, blocks per row, 16, bytes per block] (see the top)
// allow_vnni: false keeps to maddubs + madd where the CPU has VNNI (the tests hold the two
// to the same bits)
at::Tensor tiled_gemm_int8(at::Tensor x, const at::Tensor& tiles,
                           const c10::optional<at::Tensor>& bias, bool allow_vnni) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(0) >= 1,
              "tiled_gemm_int8: 2-D float32 x with rows");
  TORCH_CHECK(tiles.dtype() == at::kByte && tiles.dim() == 4 && tiles.size(2) == kTile &&
                  tiles.is_contiguous(),
              "tiled_gemm_int8: contiguous uint8 tiles [out / 16, blocks, 16, bytes]");
  TORCH_CHECK(tiled_format(tiles.size(3)), "tiled_gemm_int8: ", tiles.size(3),
              "-byte blocks are none of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0");
  x = x.contiguous();
  const int64_t rows = x.size(0), k_dim = x.size(1), n_dim = tiles.size(0) * kTile;
  TORCH_CHECK(tiles.size(1) * kGroup == k_dim, "tiled_gemm_int8: ", tiles.size(1),
              " blocks of 32 weights per row, for ", k_dim, " in_features");
  auto y = at::empty({rows, n_dim}, x.options());
  with_tile_format(tiles.size(3), [&](auto format) {
    tiled_all<decltype(format)>(allow_vnni && kHasVnni, rows, x.data_ptr<float>(), tiles.data_ptr<uint8_t>(),
                                y.data_ptr<float>(), k_dim, n_dim);
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// A GGUF file's blocks, uint8 [n, blocks per row, bytes per block], regrouped into
// `tiles` (uint8 [n / 16, blocks per row, 16, bytes], contiguous; see the top): the same
// bytes but the fifth bits, which move within their word. One pass over the blocks,
// the tiles on the threads at once (torch's permuted copies took 1.5 ms a MB).
void tile_blocks_into(const at::Tensor& blocks, at::Tensor tiles) {
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 3 && blocks.is_contiguous(),
              "tile_blocks: contiguous uint8 blocks [n, blocks, bytes]");
  const int64_t n = blocks.size(0), per_row = blocks.size(1), bytes = blocks.size(2);
  TORCH_CHECK(n % kTile == 0, "tile_blocks: ", n, " features, not a multiple of 16");
  TORCH_CHECK(tiled_format(bytes), "tile_blocks: ", bytes,
              "-byte blocks are none of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0");
  TORCH_CHECK(tiles.dtype() == at::kByte && tiles.is_contiguous() &&
                  tiles.sizes() == at::IntArrayRef({n / kTile, per_row, kTile, bytes}),
              "tile_blocks: contiguous uint8 tiles [n / 16, blocks, 16, bytes]");
  // the format's fp16 fields (d; then m), and whether 4 bytes of fifth bits follow them
  const int64_t fields = (bytes == 20 || bytes == 24) ? 2 : 1;
  const int64_t fifth = (bytes == 22 || bytes == 24) ? 4 : 0;
  const int64_t words = (bytes - 2 * fields - fifth) / 4;
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = tiles.data_ptr<uint8_t>();
  at::parallel_for(0, n / kTile * per_row, 64, [&](int64_t begin, int64_t end) {
    for (int64_t cell = begin; cell < end; ++cell) {
      const int64_t tile = cell / per_row, column = cell % per_row;
      const uint8_t* from[kTile];
      for (int j = 0; j < kTile; ++j)
        from[j] = src + ((tile * kTile + j) * per_row + column) * bytes;
      uint8_t* out = dst + cell * kTile * bytes;
      for (int64_t f = 0; f < fields; ++f)
        for (int j = 0; j < kTile; ++j, out += 2) std::memcpy(out, from[j] + 2 * f, 2);
      if (fifth) {  // the file's u32: bit i is weight i's fifth bit
        for (int j = 0; j < kTile; ++j, out += 4) {
          uint32_t qh, word = 0;
          std::memcpy(&qh, from[j] + 2 * fields, 4);
          for (int c = 0; c < 4; ++c)
            for (int t = 0; t < 4; ++t) {
              word |= ((qh >> (4 * c + t)) & 1u) << (8 * c + t);
              word |= ((qh >> (16 + 4 * c + t)) & 1u) << (8 * c + 4 + t);
            }
          std::memcpy(out, &word, 4);
        }
      }
      const int64_t codes = 2 * fields + fifth;
      for (int64_t w = 0; w < words; ++w)
        for (int j = 0; j < kTile; ++j, out += 4) std::memcpy(out, from[j] + codes + 4 * w, 4);
    }
  });
}
