// The KV cache's element type, for the kernels that read or write the cache: float32, or
// bfloat16 (half the bytes; kernels widen each value to float32 as they read it, so a
// bf16 cache gives the sums of a float32 cache holding the same values, bit for bit).
#pragma once

#include <torch/extension.h>

// fn(element) with a value of the caches' element type: float or c10::BFloat16
template <typename Fn>
void with_cache_type(const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const char* name, const Fn& fn) {
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() &&
                  (key_cache.scalar_type() == at::kFloat ||
                   key_cache.scalar_type() == at::kBFloat16),
              name, ": the key and value caches in float32 or bfloat16, alike");
  if (key_cache.scalar_type() == at::kFloat)
    fn(float{});
  else
    fn(c10::BFloat16{});
}
