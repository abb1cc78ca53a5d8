// Paged decode attention for the CPU: every decode sequence reads its K/V in place, through its
// block table, instead of gathering the context into a contiguous copy first.
//
// Decode attention is memory-bound: each step reads the whole context of every sequence once.
// The gather-then-SDPA path reads it, writes a copy, and reads the copy again; this kernel reads
// it once, at close to the machine's read bandwidth:
// - each token's K (then V) rows for all KV heads are one contiguous run, streamed in order;
// - the next block's rows are prefetched while the current block is used (blocks sit at
//   unrelated addresses, which the hardware prefetcher cannot guess);
// - sequences are split into one range per thread with about equal total context, and run with
//   at::parallel_for, i.e. on torch's own OpenMP pool, never a second threading runtime.
//
// Shapes (the cache is a strided per-layer view, last dimension contiguous):
//   query        [num_seqs, num_heads, head_dim]        float32, bfloat16 or float16
//   kv_cache     [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0: K, 1: V)
//                float32, bfloat16, float16, or the codes of int8 / float8 (e4m3fn, e5m2)
//   kv_scales    [num_blocks, 2, block_size, num_kv_heads] float32, for a code cache only
//   block_tables [num_seqs, max_num_blocks] int32
//   seq_lens     [num_seqs] int32   (context length, including the token being decoded)
//   sliding_window  int, 0 for none: attend to the last `sliding_window` positions only
//   logit_softcap   float, 0 for none: each score s becomes cap * tanh(s / cap) (Gemma 2)
//   returns      [num_seqs, num_heads, head_dim]         the query's dtype
//
// Sliding window (`kvpool/attention/backend.py`): a sequence of context seq_len attends to
// positions [begin, seq_len) with begin = max(0, seq_len - sliding_window). The walk starts at
// begin's block and offset, so the blocks before the window are never read, and the scores
// hold the window only. Without a window begin is 0 and the loops are the same as before.
//
// Soft-capping (`kvpool/attention/backend.py`) rewrites a sequence's scores in one pass between
// the score loop and the softmax, so the loops over the cache are the same with or without it;
// without it the pass is skipped by one branch per sequence.
//
// Whatever the dtypes, the arithmetic is float32: each K/V element is widened as it is loaded
// (a 16-bit cache is read in place, at half the bytes of a float32 one, an 8-bit one at a
// quarter: `kv_load.h`), scores, softmax and the weighted sum accumulate in float32, and the
// output is narrowed once at the end.
//
// Quantized caches are dequantized in registers, never into a copy. A row's K is `s * code`
// with one scale s per (token, KV head), so dot(q, s * code) = s * dot(q, code): the scale
// multiplies the row's score once; likewise V's scale joins the softmax weight (p * s). The
// result equals attention over the dequantized rows up to float32 rounding.
//
// Grouped-query attention: the `group_size = num_heads / num_kv_heads` query heads that share a
// KV head use each loaded K and V row in turn. Two passes over the context: scores (reading K),
// then the softmax-weighted sum (reading V); the scores of one sequence fit in cache.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "kv_load.h"

namespace {

using kv_load::as_float;
using kv_load::kCodeUnit;
using kv_load::kIsCode;
#if defined(__AVX512F__)
using kv_load::load_wide;
using kv_load::WideRow;
#endif

struct HeadShape {
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t group_size;  // query heads per KV head
  int64_t head_dim;
};

struct CacheLayout {
  int64_t block_stride;  // elements between consecutive blocks
  int64_t kv_stride;     // elements from a token's K row to its V row
  int64_t token_stride;  // elements between consecutive tokens of a block
  int64_t head_stride;   // elements between consecutive KV heads of a token
  int64_t block_size;
  // The same strides of kv_scales, in floats (code caches only; 0 otherwise).
  int64_t scale_block_stride, scale_kv_stride, scale_token_stride, scale_head_stride;
};

// `kHeadDim` > 0 fixes head_dim at compile time so the row loops unroll and vectorise fully;
// 0 reads it at run time.
template <int64_t kHeadDim>
inline float dot(const float* __restrict a, const float* __restrict b, int64_t head_dim) {
  const int64_t n = kHeadDim > 0 ? kHeadDim : head_dim;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

template <int64_t kHeadDim>
inline void add_scaled(float* __restrict acc, const float* __restrict row, float weight,
                       int64_t head_dim) {
  const int64_t n = kHeadDim > 0 ? kHeadDim : head_dim;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += weight * row[i];
}

#if defined(__AVX512F__)
template <int64_t kLanes>
inline float dot_wide(const float* __restrict query, const WideRow<kLanes>& key) {
  __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(query), key.lanes[0]);
  for (int64_t l = 1; l < kLanes; ++l)
    sum = _mm512_fmadd_ps(_mm512_loadu_ps(query + 16 * l), key.lanes[l], sum);
  return _mm512_reduce_add_ps(sum);
}

template <int64_t kLanes>
inline void add_scaled_wide(float* __restrict acc, const WideRow<kLanes>& value, float weight) {
  const __m512 w = _mm512_set1_ps(weight);
  for (int64_t l = 0; l < kLanes; ++l)
    _mm512_storeu_ps(acc + 16 * l,
                     _mm512_fmadd_ps(w, value.lanes[l], _mm512_loadu_ps(acc + 16 * l)));
}
#endif

// Asks for `count` elements from `row` to be brought into cache ahead of use. Blocks sit at
// unrelated addresses, so the hardware prefetcher cannot guess where the next block starts;
// without this every block's first rows would wait for memory.
template <typename T>
inline void prefetch(const T* row, int64_t count) {
  constexpr int64_t kPerLine = 64 / sizeof(T);
  for (int64_t i = 0; i < count; i += kPerLine) __builtin_prefetch(row + i);
}

// In place: row[i] = softmax(row)[i].
inline void softmax(float* row, int64_t length) {
  const float row_max = *std::max_element(row, row + length);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < length; ++i) {
    row[i] = std::exp(row[i] - row_max);
    total += row[i];
  }
  const float inverse_total = 1.0f / total;
#pragma omp simd
  for (int64_t i = 0; i < length; ++i) row[i] *= inverse_total;
}

// The softmax weights of `num_heads` rows of `length` scores, in place; each score first
// soft-capped to cap * tanh(s / cap) when `softcap` > 0.
inline void scores_to_weights(float* scores, int64_t num_heads, int64_t length, float softcap) {
  if (softcap > 0.0f) {
    const float inverse_cap = 1.0f / softcap;
#pragma omp simd
    for (int64_t i = 0; i < num_heads * length; ++i)
      scores[i] = softcap * std::tanh(scores[i] * inverse_cap);
  }
  for (int64_t h = 0; h < num_heads; ++h) softmax(scores + h * length, length);
}

// One plane (K or V) of the cache: where its rows start and, for a code cache, their scales.
template <typename T>
struct Plane {
  const T* rows;
  const float* scales;  // nullptr unless kIsCode<T>
};

template <typename T>
inline Plane<T> value_plane(const Plane<T>& keys, const CacheLayout& layout) {
  return {keys.rows + layout.kv_stride,
          kIsCode<T> ? keys.scales + layout.scale_kv_stride : nullptr};
}

// What turns row `kv_head` of a token's widened elements into values: its scale times the code
// unit for a code cache; 1 for a float one, which the compiler folds away.
template <typename T>
inline float row_scale(const float* token_scales, int64_t kv_head, const CacheLayout& layout) {
  if constexpr (kIsCode<T>) {
    return token_scales[kv_head * layout.scale_head_stride] * kCodeUnit<T>;
  } else {
    return 1.0f;
  }
}

// The positions a sequence attends to: [begin, end), begin > 0 only under a sliding window.
struct Span {
  int64_t begin;
  int64_t end;  // the context length
  int64_t length() const { return end - begin; }
};

// Calls visit(i, rows, scales) for positions span.begin + i, i = 0..span.length()-1 in order,
// where `rows` points at that token's rows for all KV heads in `plane` and `scales` at their
// scales (nullptr for a float cache). Walks the block table once from the span's first block,
// prefetching the next block's rows (and scales) as it goes.
template <typename T, typename Visit>
inline void for_each_token(const Plane<T>& plane, const int32_t* block_table, Span span,
                           const HeadShape& heads, const CacheLayout& layout, Visit&& visit) {
  const int64_t row_elements = heads.num_kv_heads * layout.head_stride;
  const int64_t num_blocks = (span.end + layout.block_size - 1) / layout.block_size;
  for (int64_t b = span.begin / layout.block_size; b < num_blocks; ++b) {
    const int64_t block = block_table[b], next = block_table[std::min(b + 1, num_blocks - 1)];
    const T* rows = plane.rows + block * layout.block_stride;
    const T* next_rows = plane.rows + next * layout.block_stride;
    const int64_t first = b * layout.block_size - span.begin;  // the index of the block's token 0
    const int64_t count = std::min(layout.block_size, span.end - span.begin - first);
    for (int64_t t = std::max<int64_t>(0, -first); t < count; ++t) {
      prefetch(next_rows + t * layout.token_stride, row_elements);
      const float* scales = nullptr;
      if constexpr (kIsCode<T>) {
        scales = plane.scales + block * layout.scale_block_stride + t * layout.scale_token_stride;
        prefetch(plane.scales + next * layout.scale_block_stride + t * layout.scale_token_stride,
                 heads.num_kv_heads * layout.scale_head_stride);
      }
      visit(first + t, rows + t * layout.token_stride, scales);
    }
  }
}

#if defined(__AVX512F__)
// `attend_sequence` for head_dim = kLanes * 16 with AVX-512: each K and V row is widened into
// registers once and serves the whole query group.
template <int64_t kLanes, typename T>
void attend_sequence_wide(const float* __restrict query, float* __restrict out,
                          const Plane<T>& cache, const int32_t* block_table, Span span,
                          const HeadShape& heads, const CacheLayout& layout,
                          float* __restrict scores, float softcap) {
  constexpr int64_t kHeadDim = kLanes * 16;
  const int64_t length = span.length();
  WideRow<kLanes> row;
  for_each_token(cache, block_table, span, heads, layout,
                 [&](int64_t position, const T* keys, const float* scales) {
                   for (int64_t kv_head = 0, h = 0; kv_head < heads.num_kv_heads; ++kv_head) {
                     load_wide(row, keys + kv_head * layout.head_stride);
                     const float s = row_scale<T>(scales, kv_head, layout);
                     for (int64_t g = 0; g < heads.group_size; ++g, ++h)
                       scores[h * length + position] = dot_wide(query + h * kHeadDim, row) * s;
                   }
                 });
  scores_to_weights(scores, heads.num_heads, length, softcap);
  std::fill(out, out + heads.num_heads * kHeadDim, 0.0f);
  for_each_token(value_plane(cache, layout), block_table, span, heads, layout,
                 [&](int64_t position, const T* values, const float* scales) {
                   for (int64_t kv_head = 0, h = 0; kv_head < heads.num_kv_heads; ++kv_head) {
                     load_wide(row, values + kv_head * layout.head_stride);
                     const float s = row_scale<T>(scales, kv_head, layout);
                     for (int64_t g = 0; g < heads.group_size; ++g, ++h)
                       add_scaled_wide(out + h * kHeadDim, row, scores[h * length + position] * s);
                   }
                 });
}
#endif

// Attention of one sequence's `num_heads` query rows (contiguous [num_heads, head_dim], already
// scaled) over its context: each token's K (then V) rows for all KV heads are one contiguous
// run, so the cache is streamed, never re-read. Query head h = kv_head * group_size + g.
// `scores` is scratch for [num_heads, span.length()] floats; `out` is [num_heads, head_dim].
// `softcap` > 0 soft-caps the scores (0: off).
template <int64_t kHeadDim, typename T>
void attend_sequence(const float* __restrict query, float* __restrict out, const Plane<T>& cache,
                     const int32_t* block_table, Span span, const HeadShape& heads,
                     const CacheLayout& layout, float* __restrict scores, float softcap) {
#if defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
    attend_sequence_wide<kHeadDim / 16>(query, out, cache, block_table, span, heads, layout,
                                        scores, softcap);
    return;
  }
#endif
  const int64_t head_dim = heads.head_dim, length = span.length();
  std::vector<float> row(static_cast<size_t>(head_dim));
  for_each_token(cache, block_table, span, heads, layout,
                 [&](int64_t position, const T* keys, const float* scales) {
                   for (int64_t kv_head = 0, h = 0; kv_head < heads.num_kv_heads; ++kv_head) {
                     const float* key = as_float(keys + kv_head * layout.head_stride, row.data(),
                                                 head_dim);
                     const float s = row_scale<T>(scales, kv_head, layout);
                     for (int64_t g = 0; g < heads.group_size; ++g, ++h)
                       scores[h * length + position] =
                           dot<kHeadDim>(query + h * head_dim, key, head_dim) * s;
                   }
                 });
  scores_to_weights(scores, heads.num_heads, length, softcap);
  std::fill(out, out + heads.num_heads * head_dim, 0.0f);
  for_each_token(value_plane(cache, layout), block_table, span, heads, layout,
                 [&](int64_t position, const T* values, const float* scales) {
                   for (int64_t kv_head = 0, h = 0; kv_head < heads.num_kv_heads; ++kv_head) {
                     const float* value = as_float(values + kv_head * layout.head_stride,
                                                   row.data(), head_dim);
                     const float s = row_scale<T>(scales, kv_head, layout);
                     for (int64_t g = 0; g < heads.group_size; ++g, ++h)
                       add_scaled<kHeadDim>(out + h * head_dim, value,
                                            scores[h * length + position] * s, head_dim);
                   }
                 });
}

// The positions sequence `seq` attends to.
inline Span span_of(const int32_t* seq_lens, int64_t seq, int64_t sliding_window) {
  const int64_t end = seq_lens[seq];
  return {sliding_window > 0 ? std::max<int64_t>(0, end - sliding_window) : 0, end};
}

// Splits sequences [0, num_seqs) into `num_parts` contiguous ranges of about equal total
// attended context (the work is proportional to it): part p is [bounds[p], bounds[p + 1]).
std::vector<int64_t> balanced_bounds(const int32_t* seq_lens, int64_t num_seqs,
                                     int64_t sliding_window, int64_t num_parts) {
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total += span_of(seq_lens, s, sliding_window).length();
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    done += span_of(seq_lens, s, sliding_window).length();
    const int64_t part = static_cast<int64_t>(bounds.size());
    if (part < num_parts && done * num_parts >= total * part) bounds.push_back(s + 1);
  }
  while (static_cast<int64_t>(bounds.size()) <= num_parts) bounds.push_back(num_seqs);
  return bounds;
}

bool is_code_dtype(at::ScalarType type) {
  return type == at::kChar || type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
}

// Checks the inputs, the block ids included (cheap next to the reads: one id per block).
void check_inputs(const at::Tensor& query, const at::Tensor& kv_cache,
                  const std::optional<at::Tensor>& kv_scales, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, int64_t sliding_window, double logit_softcap) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(logit_softcap >= 0, "logit_softcap must be >= 0 (0: none), got ", logit_softcap);
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "query must be 3-D and kv_cache 5-D");
  const auto is_float = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
           t.scalar_type() == at::kHalf;
  };
  const bool is_code = is_code_dtype(kv_cache.scalar_type());
  TORCH_CHECK(is_float(query) && (is_float(kv_cache) || is_code),
              "paged_decode supports float32, bfloat16 and float16 only (and int8 or float8 "
              "e4m3fn / e5m2 codes in the cache)");
  TORCH_CHECK(is_code == kv_scales.has_value(),
              is_code ? "an int8 / float8 kv_cache needs its kv_scales"
                      : "kv_scales belong to an int8 / float8 kv_cache only");
  if (is_code) {
    TORCH_CHECK(kv_scales->scalar_type() == at::kFloat && kv_scales->dim() == 4 &&
                    kv_scales->sizes() == kv_cache.sizes().slice(0, 4),
                "kv_scales must be float32 [num_blocks, 2, block_size, num_kv_heads]");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(kv_cache.stride(4) == 1, "kv_cache must be contiguous in head_dim");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && num_heads % kv_cache.size(3) == 0,
              "query and kv_cache head shapes disagree");
  TORCH_CHECK(block_tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs,
              "one block table and one length per sequence");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_num_blocks = block_tables.size(1), block_size = kv_cache.size(2);
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_num_blocks * block_size,
                "seq_lens out of range of the block tables");
    const int64_t used_blocks = (lens[s] + block_size - 1) / block_size;
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int32_t block_id = tables[s * max_num_blocks + b];
      TORCH_CHECK(block_id >= 0 && block_id < kv_cache.size(0), "block id ", block_id,
                  " out of range");
    }
  }
}

// The typed body: query element type Q (also the output's), cache element type T.
template <typename Q, typename T>
void run(const at::Tensor& query, const at::Tensor& kv_cache,
         const std::optional<at::Tensor>& kv_scales, const at::Tensor& block_tables,
         const at::Tensor& seq_lens, int64_t sliding_window, float scale, float softcap,
         at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const HeadShape heads{num_heads, num_kv_heads, num_heads / num_kv_heads, head_dim};
  CacheLayout layout{kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                     kv_cache.stride(3), kv_cache.size(2), 0, 0, 0, 0};
  Plane<T> cache{kv_cache.data_ptr<T>(), nullptr};
  if constexpr (kIsCode<T>) {
    layout.scale_block_stride = kv_scales->stride(0);
    layout.scale_kv_stride = kv_scales->stride(1);
    layout.scale_token_stride = kv_scales->stride(2);
    layout.scale_head_stride = kv_scales->stride(3);
    cache.scales = kv_scales->data_ptr<float>();
  }
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_num_blocks = block_tables.size(1);
  const Q* query_data = query.data_ptr<Q>();
  Q* out_data = out.data_ptr<Q>();
  const auto attend = head_dim == 64    ? &attend_sequence<64, T>
                      : head_dim == 128 ? &attend_sequence<128, T>
                                        : &attend_sequence<0, T>;
  const int64_t row = num_heads * head_dim;
  const int64_t num_parts = std::min<int64_t>(at::get_num_threads(), num_seqs);
  const std::vector<int64_t> bounds = balanced_bounds(lens, num_seqs, sliding_window, num_parts);
  at::parallel_for(0, num_parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, scaled_query(row), acc(row);
    for (int64_t seq = bounds[begin]; seq < bounds[end]; ++seq) {
      const Span span = span_of(lens, seq, sliding_window);
      scores.resize(static_cast<size_t>(num_heads * span.length()));
      const Q* seq_query = query_data + seq * row;
      for (int64_t i = 0; i < row; ++i) scaled_query[i] = static_cast<float>(seq_query[i]) * scale;
      attend(scaled_query.data(), acc.data(), cache, tables + seq * max_num_blocks, span, heads,
             layout, scores.data(), softcap);
      Q* seq_out = out_data + seq * row;
      for (int64_t i = 0; i < row; ++i) seq_out[i] = static_cast<Q>(acc[i]);
    }
  });
}

template <typename Q>
void run_for_query(const at::Tensor& query, const at::Tensor& kv_cache,
                   const std::optional<at::Tensor>& kv_scales, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, int64_t sliding_window, float scale,
                   float softcap, at::Tensor& out) {
  const auto body = [&](auto tag) {
    run<Q, decltype(tag)>(query, kv_cache, kv_scales, block_tables, seq_lens, sliding_window,
                          scale, softcap, out);
  };
  switch (kv_cache.scalar_type()) {
    case at::kFloat: return body(float{});
    case at::kBFloat16: return body(c10::BFloat16{});
    case at::kHalf: return body(c10::Half{});
    case at::kChar: return body(int8_t{});
    case at::kFloat8_e4m3fn: return body(c10::Float8_e4m3fn{});
    default: return body(c10::Float8_e5m2{});
  }
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        const std::optional<at::Tensor>& kv_scales, int64_t sliding_window,
                        double logit_softcap) {
  const at::Tensor query_c = query.contiguous();
  const at::Tensor tables_c = block_tables.contiguous();
  const at::Tensor lens_c = seq_lens.contiguous();
  check_inputs(query_c, kv_cache, kv_scales, tables_c, lens_c, sliding_window, logit_softcap);
  at::Tensor out = at::empty_like(query_c);
  const float scale_f = static_cast<float>(scale), cap = static_cast<float>(logit_softcap);
  switch (query_c.scalar_type()) {
    case at::kFloat:
      run_for_query<float>(query_c, kv_cache, kv_scales, tables_c, lens_c, sliding_window,
                                 scale_f, cap, out);
      break;
    case at::kBFloat16:
      run_for_query<c10::BFloat16>(query_c, kv_cache, kv_scales, tables_c, lens_c, sliding_window,
                                 scale_f, cap, out);
      break;
    default:
      run_for_query<c10::Half>(query_c, kv_cache, kv_scales, tables_c, lens_c, sliding_window,
                                 scale_f, cap, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvpool_cpu, m) {
  m.def(
      "paged_decode(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, Tensor? kv_scales=None, int sliding_window=0, float logit_softcap=0.0) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(kvpool_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
