// What each kernel source gives the others and bindings.cpp, on ATen's headers alone: only
// bindings.cpp includes torch/extension.h (torch's autograd, its Python bindings and
// pybind11's casters), which takes 19.5 s to parse against ATen/ATen.h's 5.6 s, a source
// and a build at a time (docs/benchmarks.md).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

// layers.cpp
at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight,
                        double eps, bool bf16_out);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
std::vector<at::Tensor> rotary_split_bf16(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                                          int64_t num_heads, int64_t num_kv_heads);
at::Tensor silu_and_mul(at::Tensor gate_up, bool approx_exp = false);
void write_kv(at::Tensor k, at::Tensor v, at::Tensor key_cache, at::Tensor value_cache,
              at::Tensor slots);
at::Tensor linear_split_rows(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                             int64_t parts);
at::Tensor argmax_rows(const at::Tensor& x);

// small_gemm.cpp
bool small_gemm_supported(int64_t rows, int64_t in_features, int64_t out_features);
at::Tensor small_gemm(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);

// block_gemm.cpp
bool block_gemm_supported(int64_t in_features, int64_t out_features, int64_t block_bytes);
at::Tensor block_gemm(at::Tensor x, at::Tensor blocks, c10::optional<at::Tensor> bias);
at::Tensor block_gemm_int8(at::Tensor x, at::Tensor blocks, c10::optional<at::Tensor> bias);
at::Tensor dequantize_blocks(const at::Tensor& blocks, bool bf16);

// int8_tiles.cpp
bool tiled_format(int64_t block_bytes);
at::Tensor tiled_gemm_int8(at::Tensor x, const at::Tensor& tiles,
                           const c10::optional<at::Tensor>& bias, bool allow_vnni);
void tile_blocks_into(const at::Tensor& blocks, at::Tensor tiles);
bool tiles_use_vnni();
std::string tiles_vnni_name();

// paged_attention.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_tables, at::Tensor context_lens, double scale);

// prefill_attention.cpp
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                   at::Tensor block_table, int64_t context_len, double scale);
at::Tensor paged_prefill_attention_bf16(at::Tensor q, at::Tensor key_cache,
                                        at::Tensor value_cache, at::Tensor block_table,
                                        int64_t context_len, double scale, bool bf16_dot);
at::Tensor paged_prefill_attention_amx(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                       at::Tensor block_table, int64_t context_len, double scale);
bool amx_supported();
bool bf16_dot_supported();
std::vector<int64_t> prefill_head_dims();

// decode_layer.cpp
// Sums a tensor over the tensor-parallel ranks in place (a Python callable, from
// pybind11's std::function caster), or empty (None): one rank.
using Reduce = std::function<void(const at::Tensor&)>;
// One layer's unchanging arguments to decode_layer, made once (decode_layers' list).
struct DecodeLayerArgs {
  std::vector<at::Tensor> weights;
  std::vector<c10::optional<at::Tensor>> packed;
  std::vector<std::vector<at::Tensor>> blocks;
  c10::optional<at::Tensor> qkv_bias;
  int64_t block_max_rows;
  std::vector<int64_t> int8_max_rows;
};
at::Tensor decode_layer(at::Tensor hidden, at::Tensor residual, bool first,
                        const std::vector<at::Tensor>& weights,
                        const std::vector<c10::optional<at::Tensor>>& packed,
                        const std::vector<std::vector<at::Tensor>>& blocks,
                        const c10::optional<at::Tensor>& qkv_bias, double eps, int64_t num_heads,
                        int64_t num_kv_heads, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& slots, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale, int64_t packed_min_rows,
                        int64_t block_max_rows, const std::vector<int64_t>& int8_max_rows,
                        const Reduce& reduce);
at::Tensor decode_layers(at::Tensor hidden,
                         const std::vector<std::shared_ptr<DecodeLayerArgs>>& layers,
                         const std::vector<at::Tensor>& kv_caches, double eps,
                         int64_t num_heads, int64_t num_kv_heads, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         double scale, int64_t packed_min_rows, const Reduce& reduce);
