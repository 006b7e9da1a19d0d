// The kernels' Python module: every function the other sources define (kernels.h), bound
// here, the one source that parses torch/extension.h (see kernels.h).
#include <pybind11/functional.h>  // decode_layer's reduce: a callable, or None
#include <torch/extension.h>

#include "kernels.h"
#include "simd.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = simd::kIsa;

  // layers.cpp
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; rms_norm(residual) * weight",
        py::arg("residual"), py::arg("delta"), py::arg("weight"), py::arg("eps"),
        py::arg("bf16_out") = false);
  m.def("rotary_", &rotary_, "in-place rotate-half rotary embedding");
  m.def("rotary_split_bf16", &rotary_split_bf16,
        "a bf16 qkv split and rotated: q in bf16, k and v in float32");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", py::arg("gate_up"),
        py::arg("approx_exp") = false);
  m.def("linear_split_rows", &linear_split_rows,
        "oneDNN's packed matmul on row ranges at once, a thread each");
  m.def("write_kv", &write_kv, "store k, v at cache slots");
  m.def("argmax_rows", &argmax_rows,
        "each row's argmax (the first of equal maxima; the first NaN), as torch's argmax");

  // decode_layer.cpp
  m.def("decode_layer", &decode_layer, "one decoder layer for a decode-only batch");
  // module_local: each ISA's build is its own extension module, and one process may load
  // several (the tests do); a type registered globally would clash with the next one's
  py::class_<DecodeLayerArgs, std::shared_ptr<DecodeLayerArgs>>(
      m, "DecodeLayerArgs", "one layer's unchanging arguments to decode_layer", py::module_local())
      .def(py::init([](std::vector<at::Tensor> weights,
                       std::vector<c10::optional<at::Tensor>> packed,
                       std::vector<std::vector<at::Tensor>> blocks,
                       c10::optional<at::Tensor> qkv_bias, int64_t block_max_rows,
                       std::vector<int64_t> int8_max_rows) {
        TORCH_CHECK(weights.size() == 6 && packed.size() == 4 && blocks.size() == 4 &&
                        int8_max_rows.size() == 4,
                    "DecodeLayerArgs: weights");
        return std::make_shared<DecodeLayerArgs>(DecodeLayerArgs{
            std::move(weights), std::move(packed), std::move(blocks), std::move(qkv_bias),
            block_max_rows, std::move(int8_max_rows)});
      }));
  m.def("decode_layers", &decode_layers, "every layer of a decode-only step (DecodeLayerArgs)");

  // small_gemm.cpp
  m.def("small_gemm", &small_gemm, "x W^T (+ b) for 1-8 rows of x");
  m.def("small_gemm_supported", &small_gemm_supported, "whether small_gemm takes these shapes");

  // block_gemm.cpp
  m.def("block_gemm", &block_gemm,
        "x W^T (+ b), W as GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks");
  m.def("block_gemm_int8", &block_gemm_int8,
        "block_gemm with x quantized to int8 per 32 values and integer products (4-D blocks: "
        "tiles, int8_tiles.cpp)");
  m.def("dequantize_blocks", &dequantize_blocks,
        "the float32 weights [rows, in_features] that GGUF blocks [rows, blocks, bytes] decode to "
        "(with bf16, those rounded to bfloat16)",
        py::arg("blocks"), py::arg("bf16") = false);
  m.def("block_gemm_supported", &block_gemm_supported,
        "whether block_gemm takes these shapes (in_features, out_features, bytes per block)");

  // int8_tiles.cpp
  m.def("tiled_gemm_int8", &tiled_gemm_int8,
        "x W^T (+ b) on int8 activations, W as Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks in tiles "
        "of 16 features",
        py::arg("x"), py::arg("tiles"), py::arg("bias"), py::arg("allow_vnni") = true);
  m.def("tiles_use_vnni", &tiles_use_vnni, "whether the tiles' sums use VNNI here");
  m.def("tiles_vnni_name", &tiles_vnni_name,
        "the VNNI the tiles' sums use here (avx512vnni, avxvnni), or \"\"");
  m.def("tiled_format", &tiled_format, "whether blocks of this many bytes can be tiled");
  m.def("tile_blocks_into", &tile_blocks_into,
        "GGUF blocks [n, blocks, bytes] regrouped into tiles [n / 16, blocks, 16, bytes]",
        py::arg("blocks"), py::arg("tiles"), py::call_guard<py::gil_scoped_release>());

  // paged_attention.cpp
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (CPU, float32 q, a float32 or bfloat16 cache)");

  // prefill_attention.cpp
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal prefill attention of one chunk over a paged KV cache (CPU, float32 q, a float32 "
        "or bfloat16 cache)");
  m.def("paged_prefill_attention_bf16", &paged_prefill_attention_bf16,
        "the same on bf16 q in bf16 products, bf16 out (bf16_dot: AVX512-BF16's dot product)");
  m.def("paged_prefill_attention_amx", &paged_prefill_attention_amx,
        "the same on AMX tiles (where amx_supported())");
  m.def("amx_supported", &amx_supported,
        "whether this build and CPU run the AMX attention (and Linux granted the tile state)");
  m.def("bf16_dot_supported", &bf16_dot_supported,
        "whether this build and CPU multiply bf16 pairs natively (AVX512-BF16)");
  m.attr("prefill_head_dims") = prefill_head_dims();
}
