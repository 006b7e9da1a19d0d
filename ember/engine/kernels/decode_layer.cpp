// One whole decoder layer for a decode-only batch (one new token per sequence), in one
// call: at decode batch sizes the ~25 Python-level ops of a layer cost a third of the
// step, the matmuls (memory-bound) the rest. Same math as the Python path:
//
//   residual += hidden                 (the first layer: residual = hidden)
//   x   = rms_norm(residual) * w_in
//   qkv = x W_qkv^T (+ b);  rotate q, k;  store k, v at their cache slots
//   a   = paged attention of q over each sequence's blocks
//   residual += a W_o^T
//   x   = rms_norm(residual) * w_post
//   out = (silu(x W_gate^T) * x W_up^T) W_down^T       -> returned; residual updated in place
#include "kernels.h"
#include <ATen/core/dispatch/Dispatcher.h>

namespace {

// oneDNN's linear on a pre-packed weight (the op torch registers as mkldnn::_linear_pointwise).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const c10::optional<at::Tensor>&, c10::string_view,
                                         c10::List<c10::optional<c10::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<c10::Scalar>>(), c10::nullopt);
}

// The same choice as ember.models.layers.Linear: ember's block GEMM on the GGUF blocks
// of W up to `block_max_rows` (on int8 activations up to the matmul's `int8_max_rows`),
// its small GEMM for other decode batches, oneDNN's packed weight from `packed_min_rows`
// rows on, else MKL on the plain weight. bf16 weights (under float32 x) multiply bf16 x
// into an fp32 result, as in Linear.
struct Limits {
  int64_t packed_min_rows, block_max_rows, int8_max_rows;
};

// Whether linear() multiplies `rows` rows of x on int8 activations (x rounded first)
bool takes_int8(int64_t rows, const std::vector<at::Tensor>& blocks, Limits limits) {
  return !blocks.empty() && rows <= limits.block_max_rows && rows <= limits.int8_max_rows;
}

// W's blocks: none, one matrix, or a fused W's parts in different formats (along out
// features), multiplied part by part
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& packed,
                  const std::vector<at::Tensor>& blocks,
                  const c10::optional<at::Tensor>& bias, Limits limits) {
  if (!blocks.empty() && x.size(0) <= limits.block_max_rows) {
    const auto gemm = takes_int8(x.size(0), blocks, limits) ? block_gemm_int8 : block_gemm;
    if (blocks.size() == 1) return gemm(x, blocks[0], bias);
    std::vector<at::Tensor> parts;
    for (const auto& part : blocks) parts.push_back(gemm(x, part, c10::nullopt));
    auto y = at::cat(parts, 1);
    return bias.has_value() ? y.add_(*bias) : y;
  }
  if (small_gemm_supported(x.size(0), weight.size(1), weight.size(0)))
    return small_gemm(x.contiguous(), weight, bias);
  if (weight.scalar_type() != x.scalar_type()) {
    auto low = x.to(weight.scalar_type());
    auto y = (packed.has_value() ? packed_linear(low, *packed, c10::nullopt)
                                 : at::linear(low, weight))
                 .to(x.scalar_type());
    return bias.has_value() ? y.add_(*bias) : y;
  }
  if (packed.has_value() && x.size(0) >= limits.packed_min_rows)
    return packed_linear(x, *packed, bias);
  return at::linear(x, weight, bias);
}

}  // namespace

// weights: {input_norm, post_norm, qkv, o, gate_up, down}; packed: the same four matmul
// weights in oneDNN layout (or None); blocks: the same four's GGUF blocks (see linear);
// qkv_bias optional.
at::Tensor decode_layer(at::Tensor hidden, at::Tensor residual, bool first,
                        const std::vector<at::Tensor>& weights,
                        const std::vector<c10::optional<at::Tensor>>& packed,
                        const std::vector<std::vector<at::Tensor>>& blocks,
                        const c10::optional<at::Tensor>& qkv_bias, double eps,
                        int64_t num_heads, int64_t num_kv_heads, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& slots,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t packed_min_rows, int64_t block_max_rows,
                        const std::vector<int64_t>& int8_max_rows,
                        const Reduce& reduce) {
  // reduce: empty, or (tensor parallel) the ranks' sum in place of the o and down
  // projections' partial products (a Python callable: bindings.cpp)
  TORCH_CHECK(weights.size() == 6 && packed.size() == 4 && blocks.size() == 4 &&
                  int8_max_rows.size() == 4,
              "decode_layer: weights");
  // the four matmuls' limits: they differ in int8_max_rows (by their blocks' format)
  const auto limits = [&](int i) { return Limits{packed_min_rows, block_max_rows, int8_max_rows[i]}; };
  const int64_t num_seqs = hidden.size(0), head_dim = cos.size(1);
  auto x = first ? add_rms_norm(residual, c10::nullopt, weights[0], eps, false)
                 : add_rms_norm(residual, hidden, weights[0], eps, false);
  auto qkv = linear(x, weights[2], packed[0], blocks[0], qkv_bias, limits(0))
                 .view({num_seqs, num_heads + 2 * num_kv_heads, head_dim});
  rotary_(qkv.narrow(1, 0, num_heads + num_kv_heads), cos, sin);
  write_kv(qkv.narrow(1, num_heads, num_kv_heads), qkv.narrow(1, num_heads + num_kv_heads, num_kv_heads),
           key_cache, value_cache, slots);
  auto attn = paged_decode_attention(qkv.narrow(1, 0, num_heads).contiguous(), key_cache,
                                     value_cache, block_tables, context_lens, scale);
  auto o = linear(attn.view({num_seqs, num_heads * head_dim}), weights[3], packed[1], blocks[1],
                  c10::nullopt, limits(1));
  if (reduce) reduce(o);
  x = add_rms_norm(residual, o, weights[1], eps, false);
  // where the down projection rounds its input to int8, silu's e^-|g| to 3e-6 will do
  auto act = silu_and_mul(linear(x, weights[4], packed[2], blocks[2], c10::nullopt, limits(2)),
                          takes_int8(num_seqs, blocks[3], limits(3)));
  auto down = linear(act, weights[5], packed[3], blocks[3], c10::nullopt, limits(3));
  if (reduce) reduce(down);
  return down;
}

// One layer's arguments to decode_layer that do not change from step to step, made once
// (ember.models.llama.FusedDecode): decode_layers then takes a step's layers in one call,
// with no Python between them and nothing of theirs converted again.

// Every layer of a decode-only step: decode_layer on each in turn (the first one's residual
// is `hidden` itself), then hidden + residual, as the Python loop over decode_layer gives.
// kv_caches: each layer's cache, keys at [0] and values at [1].
at::Tensor decode_layers(at::Tensor hidden,
                         const std::vector<std::shared_ptr<DecodeLayerArgs>>& layers,
                         const std::vector<at::Tensor>& kv_caches,
                         double eps, int64_t num_heads, int64_t num_kv_heads,
                         const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slots, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, double scale,
                         int64_t packed_min_rows, const Reduce& reduce) {
  TORCH_CHECK(!layers.empty() && kv_caches.size() == layers.size(),
              "decode_layers: a KV cache for each layer");
  const at::Tensor residual = hidden;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecodeLayerArgs& layer = *layers[i];
    hidden = decode_layer(hidden, residual, i == 0, layer.weights, layer.packed, layer.blocks,
                          layer.qkv_bias, eps, num_heads, num_kv_heads, cos, sin,
                          kv_caches[i][0], kv_caches[i][1], slots, block_tables, context_lens,
                          scale, packed_min_rows, layer.block_max_rows, layer.int8_max_rows,
                          reduce);
  }
  return hidden + residual;
}
