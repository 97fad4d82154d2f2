// The core both paged-attention ops share: one tile of query rows attending, with an
// online softmax, over a range of one sequence's keys read in place through its block
// table.
//
// The caches are head-major, `[num_blocks, num_kv_heads, block_size, row]`: a tile reads
// one KV head, so each block it visits is one contiguous run of block_size rows (4 KiB at
// 16 rows of 64 floats) rather than rows scattered a whole slot apart. A row is what its
// codec (kv_rows.h, the `Rows` template argument) says: head_size floats of the query's
// dtype (kv_format 0), or head_size 8-bit codes and a float32 scale (kv_format 1..3),
// read in place: the K pass dequantizes each key row into registers, the V pass each run
// of value rows into scratch, once for all of the tile's rows.
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
// template arguments, so a tile without the features compiles to the code it was before;
// so is the codec, PlainRows<T> being the float cache's code.
#pragma once

#include "kv_rows.h"  // first (through common.h): it picks the vector ISA

#include <cmath>
#include <optional>
#include <vector>

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

// Structural guards on the caches for kv_format (0: query's dtype, rows of head_size;
// 1..3: uint8, rows of head_size + 4), for callers that bypass cuda_ext.native_cpu.
inline void check_caches(const char* op, const at::Tensor& out, const at::Tensor& query,
                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                         int64_t kv_format) {
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                        value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous(),
                    op, ": caches must be contiguous and alike");
  TORCH_CHECK_VALUE(valid_kv_format(kv_format), op,
                    ": kv_format must be 0 (float cache), 1 (int8), 2 (float8_e4m3fn) or 3 "
                    "(float8_e5m2); got ", kv_format);
  const bool plain = kv_format == 0;
  const at::ScalarType cache_dtype = plain ? query.scalar_type() : at::kByte;
  TORCH_CHECK_VALUE(out.scalar_type() == query.scalar_type() &&
                        key_cache.scalar_type() == cache_dtype &&
                        value_cache.scalar_type() == cache_dtype,
                    op, plain ? ": out, query and caches must share a dtype"
                              : ": out must have the query's dtype and 8-bit caches be uint8");
  const int64_t row = query.size(2) + (plain ? 0 : kScaleBytes);
  TORCH_CHECK_VALUE(key_cache.size(3) == row && key_cache.size(1) > 0 &&
                        query.size(1) % key_cache.size(1) == 0,
                    op, ": head sizes or head counts disagree (cache rows of ", key_cache.size(3),
                    " elements, query heads of ", query.size(2),
                    plain ? ")" : " and a 4-byte scale)");
  TORCH_CHECK_VALUE(query.size(2) <= kMaxHeadSize, op, ": head_size ", query.size(2),
                    " is over the native CPU kernels' limit of ", kMaxHeadSize);
}

// The arguments both attention ops take, as raw pointers and strides.
template <typename T>
struct PagedAttentionArgs {
  T* out;  // [num_tokens, num_heads, head_size], unit stride in the last dim
  int64_t out_stride0, out_stride1;
  const T* query;  // [num_tokens, num_heads, head_size], unit stride in the last dim
  int64_t query_stride0, query_stride1;
  // [num_blocks, num_kv_heads, block_size, row_bytes] bytes, contiguous; rows as a codec
  // (kv_rows.h) reads them
  const uint8_t* key_cache;
  const uint8_t* value_cache;
  int64_t row_bytes;
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
        key_cache(static_cast<const uint8_t*>(key_t.data_ptr())),
        value_cache(static_cast<const uint8_t*>(value_t.data_ptr())),
        row_bytes(key_t.size(3) * key_t.element_size()),
        block_size(key_t.size(2)),
        num_kv_heads(key_t.size(1)),
        head_size(query_t.size(2)),
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

// One thread's buffers for tiles of up to `max_rows` rows; `decoded`: room for a chunk
// of decoded 8-bit value rows.
struct TileScratch {
  int64_t padded;  // head size rounded up to whole vectors
  std::vector<float> buf;
  float *q, *acc, *logits, *m, *l;
  float* values;  // [kChunk, padded] decoded value rows, or nullptr

  TileScratch(int64_t max_rows, int64_t head_size, bool decoded)
      : padded(cdiv(head_size, kVec) * kVec),
        buf(max_rows * (2 * padded + kChunk + 2) + (decoded ? kChunk * padded : 0)) {
    q = buf.data();
    acc = q + max_rows * padded;
    logits = acc + max_rows * padded;
    m = logits + max_rows * kChunk;
    l = m + max_rows;
    values = decoded ? l + max_rows : nullptr;
  }
};

// Calls f(std::integral_constant<int, HEAD>) with the head size a TileAttention over
// Rows is specialized for (0: generic): every one dispatch_head_size has for the float
// cache, only 64 and 128 for the 8-bit codecs (80 and 96 take the generic path: decode
// of 16 x 4096 tokens, 9 query / 3 KV heads of 80, 2 threads, 4.6 ms against 2.3 ms
// specialized and 3.9 ms over float32). Why: build time. The two kernel files take 22 s
// of CPU to build with the float cache alone (GCC 12, -O3), 88 s with the 8-bit codecs
// at every head size, 64 s with these; the whole extension 67 s (34 s on 2 cores)
// before the 8-bit codecs, 111 s (58 s) with them.
template <typename Rows, typename F>
inline void dispatch_tile_head_size(int64_t head_size, F&& f) {
  dispatch_head_size<!Rows::kScaled>(head_size, std::forward<F>(f));
}

// Online-softmax attention of one tile. Rows: the caches' codec (kv_rows.h); HEAD is the
// head size where specialized, else 0; kWindowed: mask each row to its own sliding window
// (args.window > 0); kCapped: cap the logits (args.soft_cap > 0).
template <typename T, typename Rows, int HEAD, bool kWindowed = false, bool kCapped = false>
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
  // Whole vectors and leftover elements of a row (compile-time where specialized).
  int full() const { return HEAD > 0 ? HEAD / kVec : full_; }
  int tail() const { return HEAD > 0 ? HEAD % kVec : tail_; }

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

  // The first of a run of rows of this tile's KV head in `cache`, from its slot; the
  // run's rows are row_bytes apart, up to the end of the slot's block.
  const uint8_t* rows(const uint8_t* cache, int64_t slot) const {
    const int64_t block = slot / a_.block_size;
    const int64_t offset = slot - block * a_.block_size;
    return cache + ((block * a_.num_kv_heads + kv_head_) * a_.block_size + offset) * a_.row_bytes;
  }

  // Asks for the row of `cache` at position pos + kPrefetchAhead (if it is attended).
  // Always inlined: see prefetch_rows.
  [[gnu::always_inline]] inline void prefetch_ahead(const uint8_t* cache,
                                                    const BlockTableRow& table,
                                                    int64_t pos) const {
    const int64_t ahead = pos + kPrefetchAhead;
    if (ahead >= end_) return;
    const int64_t block = ahead / a_.block_size;
    prefetch_rows<3>(rows(cache, table[block] * a_.block_size + ahead - block * a_.block_size),
                     1, 0, a_.row_bytes);
  }

  // The K pass over positions [c, c + n): logits of every row that sees each key.
  //
  // Both passes load a row's whole vectors in the unrolled loop and its tail (the generic
  // path's last, zero-padded vector) after it: a tail branch in each unrolled step cost
  // the build of each kernel file with the 8-bit codecs about 8 s (of 35).
  //
  // Decode, batch 64, context 256, 9 query / 3 KV heads of 64, 30 layers' caches (out of
  // cache), float32, 2 threads (throwaway script): the K/V read at 8-10 GB/s with the
  // token-major layout and the next block prefetched whole, 14-15 GB/s head-major with
  // the rolling prefetch (a plain sum streams 19 GB/s). GCC 12 later dropped the
  // prefetch calls (see prefetch_rows); inlined again, decode of 16 x 4096 tokens, 9
  // query / 3 KV heads of 64, float32, 2 threads, out of cache: 4.8 -> 2.5 ms.
  void scores(const BlockTableRow& table, int64_t c, int64_t n, int64_t first, int64_t last) {
    const int nvec = nv(), full = this->full(), tail = this->tail();
    for_each_block(table, a_.block_size, c, c + n, [&](int64_t pos, int64_t slot, int64_t cnt) {
      const uint8_t* keys = rows(a_.key_cache, slot);
      for (int64_t t = 0; t < cnt; ++t) {
        prefetch_ahead(a_.key_cache, table, pos + t);
        const int64_t j = pos + t - c;
        const int64_t visible = row_begin(pos + t);
        const int64_t passed = row_end(pos + t);  // last without a window
        for (int64_t r = first; r < visible; ++r) s_.logits[r * kChunk + j] = kNegInf;
        if constexpr (kWindowed) {
          for (int64_t r = passed; r < last; ++r) s_.logits[r * kChunk + j] = kNegInf;
        }
        const uint8_t* key = keys + t * a_.row_bytes;
        fvec k[kRowVecs];
        _Pragma("GCC unroll 32")
        for (int i = 0; i < full; ++i) k[i] = Rows::load(key, i * kVec);
        if (tail > 0) k[full] = Rows::load(key, full * kVec, tail);
        if constexpr (Rows::kScaled) {  // the key dequantized, in registers
          const fvec scale(Rows::scale(key, a_.head_size));
          _Pragma("GCC unroll 32")
          for (int i = 0; i < nvec; ++i) k[i] = k[i] * scale;
        }
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
  // the first row's pass asks for the values ahead. An 8-bit block is first decoded
  // (scales applied) into scratch, once for all the tile's rows. Decoded per row instead
  // (the scale in the weight), a prefill of 4 x (2048 + 256) tokens, 9 query / 3 KV
  // heads of 64, 2 threads, took 1.7x the float32 time over e4m3 (1.2x decoded once);
  // decodes were within 5% either way (throwaway script).
  void accumulate_values(const BlockTableRow& table, int64_t c, int64_t n, int64_t first,
                         int64_t last) {
    for_each_block(table, a_.block_size, c, c + n, [&](int64_t pos, int64_t slot, int64_t cnt) {
      const uint8_t* values = rows(a_.value_cache, slot);
      const int64_t first_row = std::max(first, row_begin(pos));
      const int64_t end_row = std::min(last, row_end(pos + cnt - 1));
      if (first_row >= end_row) return;
      if constexpr (Rows::kScaled) {
        decode_values(table, values, pos, seen_from(first_row, pos),
                      seen_to(end_row - 1, pos, cnt));
        add_values<PlainRows<float>, false>(table, reinterpret_cast<const uint8_t*>(s_.values),
                                            s_.padded * int64_t{sizeof(float)}, nv(), 0, c,
                                            pos, cnt, first_row, end_row);
      } else {
        add_values<Rows, true>(table, values, a_.row_bytes, full(), tail(), c, pos, cnt,
                               first_row, end_row);
      }
    });
  }

  // The first of a run of keys from `pos` row r sees (kWindowed: its window's start), as
  // an offset into the run; and the end of those it sees (up to its own position).
  int64_t seen_from(int64_t r, int64_t pos) const {
    if constexpr (kWindowed) {
      return std::max<int64_t>(0, a_.first_visible(pos0_ + r / a_.group) - pos);
    }
    return 0;
  }
  int64_t seen_to(int64_t r, int64_t pos, int64_t cnt) const {
    return std::min(cnt, pos0_ + r / a_.group + 1 - pos);
  }

  // Rows [from, to) of the run of 8-bit value rows at `values` (position pos on), each
  // times its scale, into s_.values (rows s_.padded floats apart, zero-padded); asks for
  // the values ahead.
  void decode_values(const BlockTableRow& table, const uint8_t* values, int64_t pos,
                     int64_t from, int64_t to) {
    const int full = this->full(), tail = this->tail();
    for (int64_t t = from; t < to; ++t) {
      prefetch_ahead(a_.value_cache, table, pos + t);
      const uint8_t* value = values + t * a_.row_bytes;
      const fvec scale(Rows::scale(value, a_.head_size));
      float* dst = s_.values + t * s_.padded;
      _Pragma("GCC unroll 32")
      for (int i = 0; i < full; ++i) (Rows::load(value, i * kVec) * scale).store(dst + i * kVec);
      if (tail > 0) (Rows::load(value, full * kVec, tail) * scale).store(dst + full * kVec);
    }
  }

  // Rows [first_row, end_row) of the tile add the run's values they see, weighted: the
  // value rows at `values`, `stride` bytes apart, read through codec R as `full` whole
  // vectors and a `tail`; kPrefetch: the first row's pass asks for the values ahead.
  template <typename R, bool kPrefetch>
  [[gnu::always_inline]] inline void add_values(const BlockTableRow& table,
                                                const uint8_t* values, int64_t stride,
                                                int full, int tail, int64_t c, int64_t pos,
                                                int64_t cnt, int64_t first_row,
                                                int64_t end_row) {
    const int nvec = nv();
    for (int64_t r = first_row; r < end_row; ++r) {
      const int64_t from = seen_from(r, pos), seen = seen_to(r, pos, cnt);
      const float* p = s_.logits + r * kChunk + (pos - c);
      float* out = s_.acc + r * s_.padded;
      fvec acc[kRowVecs];
      _Pragma("GCC unroll 32")
      for (int i = 0; i < nvec; ++i) acc[i] = fvec::loadu(out + i * kVec);
      for (int64_t t = from; t < seen; ++t) {
        if (kPrefetch && r == first_row) prefetch_ahead(a_.value_cache, table, pos + t);
        const uint8_t* value = values + t * stride;
        const fvec w(p[t]);
        _Pragma("GCC unroll 32")
        for (int i = 0; i < full; ++i) acc[i] = at::vec::fmadd(w, R::load(value, i * kVec), acc[i]);
        if (tail > 0) acc[full] = at::vec::fmadd(w, R::load(value, full * kVec, tail), acc[full]);
      }
      _Pragma("GCC unroll 32")
      for (int i = 0; i < nvec; ++i) acc[i].store(out + i * kVec);
    }
  }

  const PagedAttentionArgs<T>& a_;
  TileScratch& s_;
  const int full_, tail_;     // whole vectors and leftover elements of a row
  int64_t rows_ = 0, pos0_ = 0, kv_head_ = 0;
  int64_t end_ = 0;  // the end of the positions attend() covers: nothing past it is asked for
};

}  // namespace pagedserve
