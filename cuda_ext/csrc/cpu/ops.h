// The native CPU ops. Layouts and contracts: cuda_ext/native_cpu.py (the checked
// wrappers); the math: cuda_ext/reference.py (the oracle the tests hold them to).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace pagedserve {

// out, query: [num_seqs, num_heads, head_size]; caches: head-major, [num_blocks,
// num_kv_heads, block_size, row], a row by kv_format (cuda_ext/kv_quant.py): 0, head_size
// values of the query's dtype; 1 (int8), 2 (float8_e4m3fn), 3 (float8_e5m2), uint8 rows of
// head_size codes and a float32 scale (head_size + 4 bytes). block_tables: [num_seqs,
// max_blocks] int32/int64; seq_lens: [num_seqs] int64, context lengths including the
// query token. Both attention ops: sliding_window 0 (none) or W (a query at p sees keys
// p - W < j <= p; blocks wholly before are not read, their table entries may be
// anything); soft_cap 0 (none) or c (logits -> c * tanh(logit / c)); sinks none or
// float32 [num_heads] sink logits.
void paged_attention_decode(const at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t sliding_window, double soft_cap,
                            const std::optional<at::Tensor>& sinks, int64_t kv_format);

// out, query: [num_tokens, num_heads, head_size]; query_start_loc: [num_seqs + 1] int64,
// cumulative query lengths; seq_lens: [num_seqs] int64, context lengths including the
// query tokens, which are each sequence's last positions (causal).
void paged_attention_prefill(const at::Tensor& out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                             double soft_cap, const std::optional<at::Tensor>& sinks,
                             int64_t kv_format);

// key, value: [num_tokens, num_kv_heads, head_size] (unit stride in the last dim), the
// caches' dtype (kv_format 0) or float32 / bfloat16 coded into 8-bit rows (1..3, as
// cuda_ext.kv_quant.quantize_rows); slot_mapping: [num_tokens] int64, < 0 for padding.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& slot_mapping, int64_t kv_format);

// Every layer's caches, blocks along dim 0 (any dtype: byte copies, an 8-bit row's scale
// moving with its codes); block_mapping: [num_pairs, 2] int64 (src, dst).
void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping);

// src, dst: caches of one block shape, blocks along dim 0; block_mapping: [n, 2] int64.
void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping);

// The elementwise ops of a Llama decoder layer. Rows: [num_tokens, d] with unit last
// stride (any row stride); float32 or bfloat16, math in float32, rounded where torch's
// op chain rounds (see cuda_ext/reference.py).

// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)); out: like x, may be x;
// weight: [hidden_size], x's dtype.
void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);

// In place: residual = residual + x; x = rms_norm(residual) (x, residual: like each other).
void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps);

// out: [num_tokens, d] = silu(gate_up[:, :d]) * gate_up[:, d:]; gate_up: [num_tokens, 2 * d].
void silu_and_mul(const at::Tensor& out, const at::Tensor& gate_up);

// In place, rotate-half: query [num_tokens, num_heads, head_size], key [num_tokens,
// num_kv_heads, head_size] (unit last stride); positions: [num_tokens] int64; cos, sin:
// [max_positions, head_size] float32 or the heads' dtype (the first half of a row is read).
void rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                      const at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin);

// out: [M, N] = x @ W.T, x: [M, k] float32 or bfloat16 (unit last stride; out likewise,
// x's dtype), W kept quantized: blocks [N, ceil(k / block) * block_bytes] uint8,
// contiguous, in ggml's layout of qtype (a ggml type id: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K, Q6_K; see quant_blocks.h). `levels` 1 and 2 quantize activations per
// block (int8): 1 rounds each block once (llama.cpp's scheme), 2 also rounds what that
// left (a second int8 row, about 16-bit activations, twice the integer work). -1 and 0
// round nothing: W decoded into float32 panels, multiplied by oneDNN's linear (-1; the
// caller checks torch has oneDNN) or torch's mm (0).
void quantized_matmul(const at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks,
                      int64_t qtype, int64_t k, int64_t levels);

}  // namespace pagedserve
