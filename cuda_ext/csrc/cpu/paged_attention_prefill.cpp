// Prefill / chunked-prefill attention: each sequence's last q_len positions attend,
// causally, over its whole paged context (the cached prefix and this chunk, all read in
// place). Parallel over (sequence, KV head, query tile); a tile is up to kTileRows query
// rows (tokens x the group's heads), so each K/V row loaded serves the whole tile. With
// a sliding window a tile starts at its first row's first visible key (no block before
// it is read) and masks each row to its own window (a kWindowed TileAttention). The
// caches' rows are read through their codec (kv_rows.h): float rows, or 8-bit codes and
// a scale.
#include "attention_tile.h"  // first: it picks the vector ISA
#include "ops.h"

#include <ATen/Parallel.h>

namespace pagedserve {
namespace {

// One tile of work: query tokens [first, first + count) of sequence `seq` (counted
// from the sequence's first query token).
struct PrefillTile {
  int64_t seq, first, count;
};

std::vector<PrefillTile> make_tiles(const int64_t* query_start_loc, int64_t num_seqs,
                                    int64_t tile_tokens) {
  std::vector<PrefillTile> tiles;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    for (int64_t first = 0; first < q_len; first += tile_tokens) {
      tiles.push_back({s, first, std::min(tile_tokens, q_len - first)});
    }
  }
  return tiles;
}

template <typename T, typename Rows, int HEAD, bool kWindowed, bool kCapped>
void prefill(const PagedAttentionArgs<T>& a, const at::Tensor& block_tables,
             const int64_t* query_start_loc, const int64_t* seq_lens,
             const std::vector<PrefillTile>& tiles, int64_t tile_tokens, int threads) {
  const int64_t items = static_cast<int64_t>(tiles.size()) * a.num_kv_heads;
#pragma omp parallel num_threads(threads)
  {
    TileScratch scratch(tile_tokens * a.group, a.head_size, Rows::kScaled);
    TileAttention<T, Rows, HEAD, kWindowed, kCapped> tile(a, scratch);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const PrefillTile& t = tiles[item / a.num_kv_heads];
      const int64_t kv_head = item % a.num_kv_heads;
      const int64_t q_len = query_start_loc[t.seq + 1] - query_start_loc[t.seq];
      const int64_t token0 = query_start_loc[t.seq] + t.first;
      const int64_t pos0 = seq_lens[t.seq] - q_len + t.first;  // of the tile's first token
      const int64_t rows = t.count * a.group;
      tile.start(rows, pos0, kv_head);
      for (int64_t r = 0; r < rows; ++r) {
        tile.load_query(r, a.query_row(token0 + r / a.group, kv_head * a.group + r % a.group));
      }
      tile.attend(block_table_row(block_tables, t.seq), a.first_visible(pos0), pos0 + t.count);
      for (int64_t r = 0; r < rows; ++r) {
        tile.store(r, a.out_row(token0 + r / a.group, kv_head * a.group + r % a.group));
      }
    }
  }
}

void check_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const at::Tensor& block_tables,
                const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                int64_t kv_format) {
  // Structural guards for callers that bypass cuda_ext.native_cpu (which explains them).
  TORCH_CHECK_VALUE(query.dim() == 3 && out.sizes() == query.sizes() &&
                        query.stride(2) == 1 && out.stride(2) == 1,
                    "paged_attention_prefill: query/out must be [num_tokens, num_heads, head_size]");
  check_caches("paged_attention_prefill", out, query, key_cache, value_cache, kv_format);
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                        block_tables.stride(1) == 1 &&
                        (block_tables.scalar_type() == at::kInt ||
                         block_tables.scalar_type() == at::kLong),
                    "paged_attention_prefill: block_tables must be [num_seqs, max_blocks] int");
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong &&
                        seq_lens.is_contiguous(),
                    "paged_attention_prefill: seq_lens must be [num_seqs] int64");
  TORCH_CHECK_VALUE(query_start_loc.dim() == 1 && query_start_loc.size(0) == num_seqs + 1 &&
                        query_start_loc.scalar_type() == at::kLong &&
                        query_start_loc.is_contiguous(),
                    "paged_attention_prefill: query_start_loc must be [num_seqs + 1] int64");
}

// The data-dependent rules: query_start_loc runs from 0 to num_tokens without going
// back, and every sequence's query fits in its context.
void check_query_layout(const int64_t* query_start_loc, const int64_t* seq_lens,
                        int64_t num_seqs, int64_t num_tokens) {
  TORCH_CHECK_VALUE(query_start_loc[0] == 0 && query_start_loc[num_seqs] == num_tokens,
                    "paged_attention_prefill: query_start_loc must run from 0 to num_tokens (",
                    num_tokens, "); got ", query_start_loc[0], " .. ",
                    query_start_loc[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    TORCH_CHECK_VALUE(q_len >= 0 && q_len <= seq_lens[s], "paged_attention_prefill: sequence ",
                      s, " has ", q_len, " query tokens but seq_lens[", s, "] = ", seq_lens[s],
                      " (query_start_loc must not decrease; seq_lens includes the query)");
  }
}

}  // namespace

void paged_attention_prefill(const at::Tensor& out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                             double soft_cap, const std::optional<at::Tensor>& sinks,
                             int64_t kv_format) {
  check_args(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
             kv_format);
  check_features("paged_attention_prefill", query, sliding_window, soft_cap, sinks);
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  check_query_layout(starts, lens, num_seqs, query.size(0));
  check_block_tables("paged_attention_prefill", block_tables, lens, num_seqs, key_cache.size(2),
                     key_cache.size(0), [&](int64_t s) {
                       // The sequence's first query token sees the earliest keys.
                       const int64_t q_len = starts[s + 1] - starts[s];
                       return first_visible(lens[s] - q_len, sliding_window);
                     });
  const int64_t group = query.size(1) / key_cache.size(1);
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group);
  const std::vector<PrefillTile> tiles = make_tiles(starts, num_seqs, tile_tokens);
  if (tiles.empty()) return;
  const int threads = at::get_num_threads();
  dispatch_dtype(query.scalar_type(), "paged_attention_prefill", [&](auto tag) {
    using T = decltype(tag);
    const PagedAttentionArgs<T> args(out, query, key_cache, value_cache, scale, sliding_window,
                                     soft_cap, sinks);
    dispatch_kv_rows<T>(kv_format, [&](auto rows) {
      dispatch_tile_head_size<decltype(rows)>(args.head_size, [&](auto head) {
        dispatch_flag(sliding_window > 0, [&](auto windowed) {
          dispatch_flag(soft_cap > 0, [&](auto capped) {
            prefill<T, decltype(rows), decltype(head)::value, decltype(windowed)::value,
                    decltype(capped)::value>(args, block_tables, starts, lens, tiles,
                                             tile_tokens, threads);
          });
        });
      });
    });
  });
}

}  // namespace pagedserve
