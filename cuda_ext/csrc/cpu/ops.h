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

// out, query: [num_tokens, num_heads, head_size]; query_start_loc: [num_seqs + 1] int64,
// cumulative query lengths; seq_lens: [num_seqs] int64, context lengths including the
// query tokens, which are each sequence's last positions (causal).
void paged_attention_prefill(const at::Tensor& out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale);

// key, value: [num_tokens, num_kv_heads, head_size] (unit stride in the last dim);
// slot_mapping: [num_tokens] int64, < 0 for padding.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& slot_mapping);

// Every layer's caches, blocks along dim 0; block_mapping: [num_pairs, 2] int64 (src, dst).
void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping);

// src, dst: caches of one block shape, blocks along dim 0; block_mapping: [n, 2] int64.
void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping);

}  // namespace pagedserve
