// Decode attention: one query token per sequence (the last position of its context)
// over the whole paged context (or its sliding window: the blocks before it are not
// read), GQA-aware. Parallel over (sequence, KV head); when those tasks are few next to
// the threads and the attended spans are long, each span is also split into partitions
// (of at least kMinPartition tokens) computed in parallel, each giving (max, sum,
// unnormalized output), merged afterwards (with the sinks, if any). The caches' rows are
// read through their codec (kv_rows.h): float rows, or 8-bit codes and a scale.
#include "attention_tile.h"  // first: it picks the vector ISA
#include "ops.h"

#include <ATen/Parallel.h>

namespace pagedserve {
namespace {

constexpr int64_t kMinPartition = 512;  // tokens: shorter parts cost more to merge
constexpr int64_t kItemsPerThread = 4;  // the split aims for this many work items a thread

// How many partitions each span is split into: 1 (no split) when there are enough
// (sequence, KV head) tasks for the threads or the spans are short.
int64_t num_partitions(int64_t tasks, int64_t max_span, int threads) {
  return std::min(cdiv(max_span, kMinPartition), cdiv(kItemsPerThread * threads, tasks));
}

template <typename T, typename Rows, int HEAD, bool kCapped>
void decode_whole(const PagedAttentionArgs<T>& a, const at::Tensor& block_tables,
                  const int64_t* seq_lens, int64_t num_seqs, int threads) {
  const int64_t tasks = num_seqs * a.num_kv_heads;
#pragma omp parallel num_threads(threads)
  {
    TileScratch scratch(a.group, a.head_size, Rows::kScaled);
    TileAttention<T, Rows, HEAD, false, kCapped> tile(a, scratch);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t seq = task / a.num_kv_heads, kv_head = task % a.num_kv_heads;
      const int64_t len = seq_lens[seq];
      tile.start(a.group, len - 1, kv_head);
      for (int64_t g = 0; g < a.group; ++g) {
        tile.load_query(g, a.query_row(seq, kv_head * a.group + g));
      }
      tile.attend(block_table_row(block_tables, seq), a.first_visible(len - 1), len);
      for (int64_t g = 0; g < a.group; ++g) tile.store(g, a.out_row(seq, kv_head * a.group + g));
    }
  }
}

// Partition results: per (sequence, KV head, partition, group row) the max logit, the
// sum of exp(logit - max) and the unnormalized output, merged into `out` afterwards.
struct Partials {
  int64_t partitions, group, head_size;
  std::vector<float> data;

  Partials(int64_t tasks, int64_t partitions_, int64_t group_, int64_t head_size_)
      : partitions(partitions_),
        group(group_),
        head_size(head_size_),
        data(tasks * partitions_ * group_ * (head_size_ + 2)) {}

  float* row(int64_t task, int64_t part, int64_t g) {
    return data.data() + ((task * partitions + part) * group + g) * (head_size + 2);
  }
};

template <typename T, typename Rows, int HEAD, bool kCapped>
void decode_partitioned(const PagedAttentionArgs<T>& a, const at::Tensor& block_tables,
                        const int64_t* seq_lens, int64_t num_seqs, int64_t max_span,
                        int64_t partitions, int threads) {
  const int64_t tasks = num_seqs * a.num_kv_heads;
  const int64_t part_len = cdiv(cdiv(max_span, partitions), kChunk) * kChunk;
  Partials partials(tasks, partitions, a.group, a.head_size);
  const int64_t items = tasks * partials.partitions;
#pragma omp parallel num_threads(threads)
  {
    TileScratch scratch(a.group, a.head_size, Rows::kScaled);
    TileAttention<T, Rows, HEAD, false, kCapped> tile(a, scratch);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t task = item / partials.partitions, part = item % partials.partitions;
      const int64_t seq = task / a.num_kv_heads, kv_head = task % a.num_kv_heads;
      const int64_t len = seq_lens[seq], begin = a.first_visible(len - 1) + part * part_len;
      if (begin >= len) continue;
      tile.start(a.group, len - 1, kv_head);
      for (int64_t g = 0; g < a.group; ++g) {
        tile.load_query(g, a.query_row(seq, kv_head * a.group + g));
      }
      tile.attend(block_table_row(block_tables, seq), begin, std::min(len, begin + part_len));
      for (int64_t g = 0; g < a.group; ++g) {
        float* dst = partials.row(task, part, g);
        dst[0] = tile.max_logit(g);
        dst[1] = tile.exp_sum(g);
        std::copy_n(tile.unnormalized(g), a.head_size, dst + 2);
      }
    }
  }
  // Merge: out = sum_p w_p * acc_p / sum_p w_p * l_p with w_p = exp(m_p - max_p m_p)
  // (the sink joining the denominator, output_scale).
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> merged(a.head_size);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t seq = task / a.num_kv_heads, kv_head = task % a.num_kv_heads;
      const int64_t len = seq_lens[seq];
      const int64_t parts = cdiv(len - a.first_visible(len - 1), part_len);
      for (int64_t g = 0; g < a.group; ++g) {
        float m = kNegInf;
        for (int64_t p = 0; p < parts; ++p) m = std::max(m, partials.row(task, p, g)[0]);
        float l = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const float* src = partials.row(task, p, g);
          const float w = std::exp(src[0] - m);
          l += w * src[1];
          for (int64_t i = 0; i < a.head_size; ++i) merged[i] += w * src[2 + i];
        }
        const float inv = output_scale(m, l, a.sink(kv_head * a.group + g));
        T* dst = a.out_row(seq, kv_head * a.group + g);
        for (int64_t i = 0; i < a.head_size; ++i) dst[i] = static_cast<T>(merged[i] * inv);
      }
    }
  }
}

void check_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const at::Tensor& block_tables,
                const at::Tensor& seq_lens, int64_t kv_format) {
  // Structural guards for callers that bypass cuda_ext.native_cpu (which explains them).
  TORCH_CHECK_VALUE(query.dim() == 3 && out.sizes() == query.sizes() &&
                        query.stride(2) == 1 && out.stride(2) == 1,
                    "paged_attention_decode: query/out must be [num_seqs, num_heads, head_size]");
  check_caches("paged_attention_decode", out, query, key_cache, value_cache, kv_format);
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) &&
                        block_tables.stride(1) == 1 &&
                        (block_tables.scalar_type() == at::kInt ||
                         block_tables.scalar_type() == at::kLong),
                    "paged_attention_decode: block_tables must be [num_seqs, max_blocks] int");
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == query.size(0) &&
                        seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
                    "paged_attention_decode: seq_lens must be [num_seqs] int64");
}

}  // namespace

void paged_attention_decode(const at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t sliding_window, double soft_cap,
                            const std::optional<at::Tensor>& sinks, int64_t kv_format) {
  check_args(out, query, key_cache, value_cache, block_tables, seq_lens, kv_format);
  check_features("paged_attention_decode", query, sliding_window, soft_cap, sinks);
  const int64_t num_seqs = query.size(0);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t max_span = 0;  // the most keys one sequence attends
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK_VALUE(lens[s] >= 1, "paged_attention_decode: seq_lens[", s, "] = ", lens[s],
                      "; a decode sees at least its own token");
    max_span = std::max(max_span, lens[s] - first_visible(lens[s] - 1, sliding_window));
  }
  check_block_tables("paged_attention_decode", block_tables, lens, num_seqs, key_cache.size(2),
                     key_cache.size(0),
                     [&](int64_t s) { return first_visible(lens[s] - 1, sliding_window); });
  if (num_seqs == 0) return;
  const int threads = at::get_num_threads();
  const int64_t partitions = num_partitions(num_seqs * key_cache.size(1), max_span, threads);
  dispatch_dtype(query.scalar_type(), "paged_attention_decode", [&](auto tag) {
    using T = decltype(tag);
    const PagedAttentionArgs<T> args(out, query, key_cache, value_cache, scale, sliding_window,
                                     soft_cap, sinks);
    dispatch_kv_rows<T>(kv_format, [&](auto rows) {
      using Rows = decltype(rows);
      dispatch_tile_head_size<decltype(rows)>(args.head_size, [&](auto head) {
        dispatch_flag(soft_cap > 0, [&](auto capped) {
          constexpr int HEAD = decltype(head)::value;
          constexpr bool kCapped = decltype(capped)::value;
          if (partitions > 1) {
            decode_partitioned<T, Rows, HEAD, kCapped>(args, block_tables, lens, num_seqs,
                                                       max_span, partitions, threads);
          } else {
            decode_whole<T, Rows, HEAD, kCapped>(args, block_tables, lens, num_seqs, threads);
          }
        });
      });
    });
  });
}

}  // namespace pagedserve
