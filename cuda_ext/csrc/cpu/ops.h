// The native CPU ops. Layouts and contracts: cuda_ext/native_cpu.py (the checked
// wrappers); the math: cuda_ext/reference.py (the oracle the tests hold them to).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace pagedserve {

// out, query: [num_seqs, num_heads, head_size]; caches: [num_blocks, block_size,
// num_kv_heads, head_size]; block_tables: [num_seqs, max_blocks] int32/int64;
// seq_lens: [num_seqs] int64, context lengths including the query token.
void paged_attention_decode(const at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale);

}  // namespace pagedserve
