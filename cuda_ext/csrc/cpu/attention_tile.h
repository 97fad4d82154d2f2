// The core both paged-attention ops share: one tile of query rows attending, with an
// online softmax, over a range of one sequence's keys read in place through its block
// table.
//
// The caches are head-major, `[num_blocks, num_kv_heads, block_size, head_size]`: a tile
// reads one KV head, so each block it visits is one contiguous run of block_size rows
// (4 KiB at 16 rows of 64 floats) rather than rows scattered a whole slot apart.
//
// A tile is the `group` query heads that share one KV head (GQA), for one or more
// consecutive query tokens of one sequence: row r is head r % group of the tile's query
// token r / group. Keys are taken kChunk at a time: scores for the chunk, one max and
// rescale per row, then the V accumulation. The K pass loads each K row from memory once
// (into registers, as float) and scores every row of the tile with it; the V pass keeps
// one output row in registers while a block's V rows add into it, so the block comes
// from memory for the first row and from cache for the others. Both passes ask for the
// row kPrefetchAhead positions ahead (through the block table) while they work, so the
// next blocks stream in during the arithmetic instead of after it.
//
// The optional features (cuda_ext/reference.py has their math), each branched outside
// the per-key loops: a sliding window starts attend() at the first key the tile's first
// row sees (decode rows share one position, so that is all a decode needs), and
// kWindowed tiles (prefill: each row's window starts elsewhere) also mask per row, every
// row seeing a contiguous run of keys; kCapped tiles cap logits per row and chunk in
// softmax_step; sink logits only change the normalization (output_scale). Both flags are
// template arguments, so a tile without the features compiles to the code it was before.
#pragma once

#include <cmath>
#include <optional>
#include <vector>

#include "common.h"

namespace pagedserve {

constexpr int64_t kChunk = 128;  // keys per softmax step; a multiple of kVec
constexpr int64_t kTileRows = 32;  // query rows a prefill tile aims for
constexpr int64_t kPrefetchAhead = 32;  // positions between a row read and the row asked for

// The first key position a query at `pos` sees under a sliding window (0: none).
inline int64_t first_visible(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Structural guards on the optional features, for callers that bypass
// cuda_ext.native_cpu (which explains them).
inline void check_features(const char* op, const at::Tensor& query, int64_t sliding_window,
                           double soft_cap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK_VALUE(sliding_window >= 0, op, ": sliding_window must be >= 0 (0: none); got ",
                    sliding_window);
  TORCH_CHECK_VALUE(std::isfinite(soft_cap) && soft_cap >= 0, op,
                    ": soft_cap must be finite and >= 0 (0: none); got ", soft_cap);
  if (sinks && sinks->defined()) {
    TORCH_CHECK_VALUE(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                          sinks->dim() == 1 && sinks->size(0) == query.size(1) &&
                          sinks->is_contiguous(),
                      op, ": sinks must be a contiguous float32 [num_heads] CPU tensor");
  }
}

// The arguments both attention ops take, as raw pointers and strides.
template <typename T>
struct PagedAttentionArgs {
  T* out;  // [num_tokens, num_heads, head_size], unit stride in the last dim
  int64_t out_stride0, out_stride1;
  const T* query;  // [num_tokens, num_heads, head_size], unit stride in the last dim
  int64_t query_stride0, query_stride1;
  const T* key_cache;  // [num_blocks, num_kv_heads, block_size, head_size], contiguous
  const T* value_cache;
  int64_t block_size, num_kv_heads, head_size, group;
  float scale;
  int64_t window;  // 0: none; W: a query at p sees keys p - W < j <= p
  float soft_cap;  // 0: none; c: logits become c * tanh(logit / c)
  const float* sinks;  // [num_heads] sink logits, or nullptr

  PagedAttentionArgs(const at::Tensor& out_t, const at::Tensor& query_t,
                     const at::Tensor& key_t, const at::Tensor& value_t, double scale_,
                     int64_t window_, double soft_cap_, const std::optional<at::Tensor>& sinks_)
      : out(out_t.data_ptr<T>()),
        out_stride0(out_t.stride(0)),
        out_stride1(out_t.stride(1)),
        query(query_t.data_ptr<T>()),
        query_stride0(query_t.stride(0)),
        query_stride1(query_t.stride(1)),
        key_cache(key_t.data_ptr<T>()),
        value_cache(value_t.data_ptr<T>()),
        block_size(key_t.size(2)),
        num_kv_heads(key_t.size(1)),
        head_size(key_t.size(3)),
        group(query_t.size(1) / key_t.size(1)),
        scale(static_cast<float>(scale_)),
        window(window_),
        soft_cap(static_cast<float>(soft_cap_)),
        sinks(sinks_ && sinks_->defined() ? sinks_->data_ptr<float>() : nullptr) {}

  const T* query_row(int64_t token, int64_t head) const {
    return query + token * query_stride0 + head * query_stride1;
  }
  T* out_row(int64_t token, int64_t head) const {
    return out + token * out_stride0 + head * out_stride1;
  }
  int64_t first_visible(int64_t pos) const { return pagedserve::first_visible(pos, window); }
  // Query head `head`'s sink logit, or nullptr.
  const float* sink(int64_t head) const { return sinks ? sinks + head : nullptr; }
};

// The factor that turns an unnormalized output (weights exp(logit - m) summing to l)
// into the softmax's: 1 / l, or with a sink logit 1 / (l + exp(sink - m)), the sink
// taken into the max so that neither exp overflows.
inline float output_scale(float m, float l, const float* sink) {
  if (sink == nullptr) return 1.f / l;
  const float top = std::max(m, *sink);
  const float alpha = std::exp(m - top);
  return alpha / (l * alpha + std::exp(*sink - top));
}

// One thread's buffers for tiles of up to `max_rows` rows.
struct TileScratch {
  int64_t padded;  // head size rounded up to whole vectors
  std::vector<float> buf;
  float *q, *acc, *logits, *m, *l;

  TileScratch(int64_t max_rows, int64_t head_size)
      : padded(cdiv(head_size, kVec) * kVec),
        buf(max_rows * (2 * padded + kChunk + 2)) {
    q = buf.data();
    acc = q + max_rows * padded;
    logits = acc + max_rows * padded;
    m = logits + max_rows * kChunk;
    l = m + max_rows;
  }
};

// Online-softmax attention of one tile. HEAD is the head size where specialized, else 0;
// kWindowed: mask each row to its own sliding window (args.window > 0); kCapped: cap
// the logits (args.soft_cap > 0).
template <typename T, int HEAD, bool kWindowed = false, bool kCapped = false>
class TileAttention {
 public:
  // Vectors per K/V row held in registers (or, on the generic path, a stack array). The
  // `GCC unroll` pragmas on loops over them are what keeps them in registers: without,
  // GCC spilled the K row to the stack and the V pass's output row to memory.
  static constexpr int kRowVecs = cdiv(HEAD > 0 ? HEAD : kMaxHeadSize, kVec);

  TileAttention(const PagedAttentionArgs<T>& args, TileScratch& scratch)
      : a_(args),
        s_(scratch),
        full_(args.head_size / kVec),
        tail_(args.head_size % kVec) {}

  // Begins a tile of `rows` rows whose first query token sits at position `pos0`.
  void start(int64_t rows, int64_t pos0, int64_t kv_head) {
    rows_ = rows;
    pos0_ = pos0;
    kv_head_ = kv_head;
    std::fill(s_.acc, s_.acc + rows * s_.padded, 0.f);
    std::fill(s_.m, s_.m + rows, kNegInf);
    std::fill(s_.l, s_.l + rows, 0.f);
  }

  // Row r's query, times the softmax scale, zero-padded to whole vectors.
  void load_query(int64_t r, const T* src) {
    float* q = s_.q + r * s_.padded;
    for (int64_t i = 0; i < a_.head_size; ++i) q[i] = static_cast<float>(src[i]) * a_.scale;
    std::fill(q + a_.head_size, q + s_.padded, 0.f);
  }

  // Attends to keys at positions [begin, end), each row up to its own causal limit (and,
  // kWindowed, from the start of its window). Rows [first, last) see some key of a
  // chunk; only they take part in it. Inlined into each caller: out of line (GCC's
  // choice once the features grew it), the decode loop reloaded its scratch pointers per
  // key, 4% more instructions (callgrind, decode of 1 x 4096 tokens, 8 heads of 64).
  [[gnu::always_inline]] inline void attend(const BlockTableRow& table, int64_t begin,
                                            int64_t end) {
    end_ = end;
    for (int64_t c = begin; c < end; c += kChunk) {
      const int64_t n = std::min(kChunk, end - c);
      const int64_t first = row_begin(c);
      if (first >= rows_) break;  // no row sees this chunk, nor any later one
      const int64_t last = row_end(c + n - 1);
      if (first >= last) continue;
      scores(table, c, n, first, last);
      softmax_step(n, first, last);
      accumulate_values(table, c, n, first, last);
    }
  }

  // Row r's output, acc / l (with the sink of its head), in storage precision.
  void store(int64_t r, T* dst) const {
    const float inv = output_scale(s_.m[r], s_.l[r], a_.sink(kv_head_ * a_.group + r % a_.group));
    const float* acc = s_.acc + r * s_.padded;
    for (int64_t i = 0; i < a_.head_size; ++i) dst[i] = static_cast<T>(acc[i] * inv);
  }

  float max_logit(int64_t r) const { return s_.m[r]; }
  float exp_sum(int64_t r) const { return s_.l[r]; }
  const float* unnormalized(int64_t r) const { return s_.acc + r * s_.padded; }

 private:
  int nv() const { return HEAD > 0 ? kRowVecs : full_ + (tail_ > 0); }

  // The first row that sees the key at `pos`: rows of earlier query tokens do not.
  int64_t row_begin(int64_t pos) const {
    const int64_t tokens_before = pos - pos0_;
    return tokens_before <= 0 ? 0 : std::min(tokens_before * a_.group, rows_);
  }

  // The end of the rows that see the key at `pos`: kWindowed, rows of query tokens at
  // pos + window or later have left it behind.
  int64_t row_end(int64_t pos) const {
    if constexpr (kWindowed) {
      const int64_t tokens_within = pos + a_.window - pos0_;
      return tokens_within <= 0 ? 0 : std::min(tokens_within * a_.group, rows_);
    }
    return rows_;
  }

  // Vector i of a row, as float (the last one zero-padded on the generic path).
  fvec load_vec(const T* row, int i) const {
    const int full = HEAD > 0 ? HEAD / kVec : full_;
    const int tail = HEAD > 0 ? HEAD % kVec : tail_;
    return (tail > 0 && i == full) ? load_f(row + i * kVec, tail) : load_f(row + i * kVec);
  }

  // The first of a run of rows of this tile's KV head in `cache`, from its slot; the
  // run's rows are head_size apart, up to the end of the slot's block.
  const T* rows(const T* cache, int64_t slot) const {
    const int64_t block = slot / a_.block_size;
    const int64_t offset = slot - block * a_.block_size;
    return cache + ((block * a_.num_kv_heads + kv_head_) * a_.block_size + offset) * a_.head_size;
  }

  // Asks for the row of `cache` at position pos + kPrefetchAhead (if it is attended).
  void prefetch_ahead(const T* cache, const BlockTableRow& table, int64_t pos) const {
    const int64_t ahead = pos + kPrefetchAhead;
    if (ahead >= end_) return;
    const int64_t block = ahead / a_.block_size;
    prefetch_rows<3>(rows(cache, table[block] * a_.block_size + ahead - block * a_.block_size),
                     1, 0, a_.head_size * static_cast<int64_t>(sizeof(T)));
  }

  // The K pass over positions [c, c + n): logits of every row that sees each key.
  //
  // Decode, batch 64, context 256, 9 query / 3 KV heads of 64, 30 layers' caches (out of
  // cache), float32, 2 threads (throwaway script): the K/V read at 8-10 GB/s with the
  // token-major layout and the next block prefetched whole, 14-15 GB/s head-major with
  // the rolling prefetch (a plain sum streams 19 GB/s).
  void scores(const BlockTableRow& table, int64_t c, int64_t n, int64_t first, int64_t last) {
    const int nvec = nv();
    for_each_block(table, a_.block_size, c, c + n, [&](int64_t pos, int64_t slot, int64_t cnt) {
      const T* keys = rows(a_.key_cache, slot);
      for (int64_t t = 0; t < cnt; ++t) {
        prefetch_ahead(a_.key_cache, table, pos + t);
        const int64_t j = pos + t - c;
        const int64_t visible = row_begin(pos + t);
        const int64_t passed = row_end(pos + t);  // last without a window
        for (int64_t r = first; r < visible; ++r) s_.logits[r * kChunk + j] = kNegInf;
        if constexpr (kWindowed) {
          for (int64_t r = passed; r < last; ++r) s_.logits[r * kChunk + j] = kNegInf;
        }
        fvec k[kRowVecs];
        _Pragma("GCC unroll 32")
        for (int i = 0; i < nvec; ++i) k[i] = load_vec(keys + t * a_.head_size, i);
        for (int64_t r = visible; r < passed; ++r) {
          const float* q = s_.q + r * s_.padded;
          fvec dot(0.f);
          _Pragma("GCC unroll 32")
          for (int i = 0; i < nvec; ++i) dot = at::vec::fmadd(fvec::loadu(q + i * kVec), k[i], dot);
          s_.logits[r * kChunk + j] = reduce_add(dot);
        }
      }
    });
  }

  // Per row: the chunk's max joins the running max, acc and l are rescaled once, and
  // the logits become exp(logit - max) in place (soft-capped first, masks kept).
  void softmax_step(int64_t n, int64_t first, int64_t last) {
    const int64_t padded_n = cdiv(n, kVec) * kVec;
    for (int64_t r = first; r < last; ++r) {
      float* lg = s_.logits + r * kChunk;
      std::fill(lg + n, lg + padded_n, kNegInf);
      if constexpr (kCapped) {
        const fvec cap(a_.soft_cap), hidden(kNegInf);
        for (int64_t j = 0; j < padded_n; j += kVec) {
          const fvec x = fvec::loadu(lg + j);
          fvec::blendv(cap * (x / cap).tanh(), x, x == hidden).store(lg + j);
        }
      }
      fvec vmax(kNegInf);
      for (int64_t j = 0; j < padded_n; j += kVec) vmax = at::vec::maximum(vmax, fvec::loadu(lg + j));
      const float m_new = std::max(s_.m[r], reduce_max(vmax));
      const float alpha = std::exp(s_.m[r] - m_new);  // 0 on a row's first chunk
      const fvec shift(m_new);
      fvec vsum(0.f);
      for (int64_t j = 0; j < padded_n; j += kVec) {
        const fvec e = (fvec::loadu(lg + j) - shift).exp_u20();
        e.store(lg + j);
        vsum = vsum + e;
      }
      s_.l[r] = s_.l[r] * alpha + reduce_add(vsum);
      s_.m[r] = m_new;
      if (alpha != 1.f) {
        float* acc = s_.acc + r * s_.padded;
        const fvec va(alpha);
        for (int64_t i = 0; i < s_.padded; i += kVec) (fvec::loadu(acc + i) * va).store(acc + i);
      }
    }
  }

  // The V pass over positions [c, c + n): per block and row, the row's output stays in
  // registers while the block's values (hot in cache after the first row) add into it;
  // the first row's pass asks for the values ahead.
  void accumulate_values(const BlockTableRow& table, int64_t c, int64_t n, int64_t first,
                         int64_t last) {
    const int nvec = nv();
    for_each_block(table, a_.block_size, c, c + n, [&](int64_t pos, int64_t slot, int64_t cnt) {
      const T* values = rows(a_.value_cache, slot);
      const int64_t first_row = std::max(first, row_begin(pos));
      const int64_t end_row = std::min(last, row_end(pos + cnt - 1));
      for (int64_t r = first_row; r < end_row; ++r) {
        // Row r sees keys up to position pos0 + r / group (kWindowed: from its window on).
        const int64_t seen = std::min(cnt, pos0_ + r / a_.group + 1 - pos);
        int64_t from = 0;
        if constexpr (kWindowed) {
          from = std::max<int64_t>(0, a_.first_visible(pos0_ + r / a_.group) - pos);
        }
        const float* p = s_.logits + r * kChunk + (pos - c);
        float* out = s_.acc + r * s_.padded;
        fvec acc[kRowVecs];
        _Pragma("GCC unroll 32")
        for (int i = 0; i < nvec; ++i) acc[i] = fvec::loadu(out + i * kVec);
        for (int64_t t = from; t < seen; ++t) {
          if (r == first_row) prefetch_ahead(a_.value_cache, table, pos + t);
          const fvec w(p[t]);
          _Pragma("GCC unroll 32")
          for (int i = 0; i < nvec; ++i) {
            acc[i] = at::vec::fmadd(w, load_vec(values + t * a_.head_size, i), acc[i]);
          }
        }
        _Pragma("GCC unroll 32")
        for (int i = 0; i < nvec; ++i) acc[i].store(out + i * kVec);
      }
    });
  }

  const PagedAttentionArgs<T>& a_;
  TileScratch& s_;
  const int full_, tail_;     // whole vectors and leftover elements of a row
  int64_t rows_ = 0, pos0_ = 0, kv_head_ = 0;
  int64_t end_ = 0;  // the end of the positions attend() covers: nothing past it is asked for
};

}  // namespace pagedserve
