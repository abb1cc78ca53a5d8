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
// Shapes (float32; the cache is a strided per-layer view, last dimension contiguous):
//   query        [num_seqs, num_heads, head_dim]
//   kv_cache     [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0: K, 1: V)
//   block_tables [num_seqs, max_num_blocks] int32
//   seq_lens     [num_seqs] int32   (context length, including the token being decoded)
//   returns      [num_seqs, num_heads, head_dim]
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
#include <vector>

namespace {

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

// Asks for `count` floats from `row` to be brought into cache ahead of use. Blocks sit at
// unrelated addresses, so the hardware prefetcher cannot guess where the next block starts;
// without this every block's first rows would wait for memory.
inline void prefetch(const float* row, int64_t count) {
  constexpr int64_t kFloatsPerLine = 64 / sizeof(float);
  for (int64_t i = 0; i < count; i += kFloatsPerLine) __builtin_prefetch(row + i);
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

// Calls visit(position, row) for positions 0..seq_len-1 in order, where `row` points at that
// token's rows for all KV heads in the plane starting at `plane` (the cache for K, the cache plus
// kv_stride for V). Walks the block table once, prefetching the next block's rows as it goes.
template <typename Visit>
inline void for_each_token(const float* plane, const int32_t* block_table, int64_t seq_len,
                           int64_t row_floats, const CacheLayout& layout, Visit&& visit) {
  const int64_t num_blocks = (seq_len + layout.block_size - 1) / layout.block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* rows = plane + block_table[b] * layout.block_stride;
    const float* next_rows =
        plane + block_table[std::min(b + 1, num_blocks - 1)] * layout.block_stride;
    const int64_t first = b * layout.block_size;
    const int64_t count = std::min(layout.block_size, seq_len - first);
    for (int64_t t = 0; t < count; ++t) {
      prefetch(next_rows + t * layout.token_stride, row_floats);
      visit(first + t, rows + t * layout.token_stride);
    }
  }
}

// Attention of one sequence's `num_heads` query rows (contiguous [num_heads, head_dim], already
// scaled) over its context: each token's K (then V) rows for all KV heads are one contiguous
// run, so the cache is streamed, never re-read. Query head h = kv_head * group_size + g.
// `scores` is scratch for [num_heads, seq_len] floats; `out` is [num_heads, head_dim].
template <int64_t kHeadDim>
void attend_sequence(const float* __restrict query, float* __restrict out, const float* cache,
                     const int32_t* block_table, int64_t seq_len, const HeadShape& heads,
                     const CacheLayout& layout, float* __restrict scores) {
  const int64_t head_dim = heads.head_dim;
  const int64_t row_floats = heads.num_kv_heads * layout.head_stride;
  for_each_token(cache, block_table, seq_len, row_floats, layout,
                 [&](int64_t position, const float* keys) {
                   for (int64_t kv_head = 0, h = 0; kv_head < heads.num_kv_heads; ++kv_head) {
                     const float* key = keys + kv_head * layout.head_stride;
                     for (int64_t g = 0; g < heads.group_size; ++g, ++h)
                       scores[h * seq_len + position] =
                           dot<kHeadDim>(query + h * head_dim, key, head_dim);
                   }
                 });
  for (int64_t h = 0; h < heads.num_heads; ++h) softmax(scores + h * seq_len, seq_len);
  std::fill(out, out + heads.num_heads * head_dim, 0.0f);
  for_each_token(cache + layout.kv_stride, block_table, seq_len, row_floats, layout,
                 [&](int64_t position, const float* values) {
                   for (int64_t kv_head = 0, h = 0; kv_head < heads.num_kv_heads; ++kv_head) {
                     const float* value = values + kv_head * layout.head_stride;
                     for (int64_t g = 0; g < heads.group_size; ++g, ++h)
                       add_scaled<kHeadDim>(out + h * head_dim, value,
                                            scores[h * seq_len + position], head_dim);
                   }
                 });
}

// Splits sequences [0, num_seqs) into `num_parts` contiguous ranges of about equal total
// context (the work is proportional to it): part p is [bounds[p], bounds[p + 1]).
std::vector<int64_t> balanced_bounds(const int32_t* seq_lens, int64_t num_seqs,
                                     int64_t num_parts) {
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total += seq_lens[s];
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    done += seq_lens[s];
    const int64_t part = static_cast<int64_t>(bounds.size());
    if (part < num_parts && done * num_parts >= total * part) bounds.push_back(s + 1);
  }
  while (static_cast<int64_t>(bounds.size()) <= num_parts) bounds.push_back(num_seqs);
  return bounds;
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "query must be 3-D and kv_cache 5-D");
  TORCH_CHECK(query.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat,
              "paged_decode supports float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(kv_cache.stride(4) == 1, "kv_cache must be contiguous in head_dim");
  const at::Tensor query_c = query.contiguous();
  const at::Tensor tables_c = block_tables.contiguous();
  const at::Tensor lens_c = seq_lens.contiguous();
  const int64_t num_seqs = query_c.size(0), num_heads = query_c.size(1);
  const int64_t head_dim = query_c.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_heads % num_kv_heads == 0,
              "query and kv_cache head shapes disagree");
  TORCH_CHECK(tables_c.size(0) == num_seqs && lens_c.size(0) == num_seqs,
              "one block table and one length per sequence");
  const int64_t group_size = num_heads / num_kv_heads;
  const CacheLayout layout{kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                           kv_cache.stride(3), kv_cache.size(2)};
  const int32_t* lens = lens_c.data_ptr<int32_t>();
  const int64_t max_num_blocks = tables_c.size(1);
  const int32_t* tables = tables_c.data_ptr<int32_t>();
  const int64_t num_blocks = kv_cache.size(0);
  for (int64_t s = 0; s < num_seqs; ++s) {  // cheap next to the reads: one id per block
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_num_blocks * layout.block_size,
                "seq_lens out of range of the block tables");
    const int64_t used_blocks = (lens[s] + layout.block_size - 1) / layout.block_size;
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int32_t block_id = tables[s * max_num_blocks + b];
      TORCH_CHECK(block_id >= 0 && block_id < num_blocks, "block id ", block_id, " out of range");
    }
  }

  at::Tensor out = at::empty_like(query_c);
  const float* query_data = query_c.data_ptr<float>();
  const float* cache_data = kv_cache.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float scale_f = static_cast<float>(scale);
  const HeadShape heads{num_heads, num_kv_heads, group_size, head_dim};
  const auto attend = head_dim == 64    ? &attend_sequence<64>
                      : head_dim == 128 ? &attend_sequence<128>
                                        : &attend_sequence<0>;
  const int64_t num_parts = std::min<int64_t>(at::get_num_threads(), num_seqs);
  const std::vector<int64_t> bounds = balanced_bounds(lens, num_seqs, num_parts);
  at::parallel_for(0, num_parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> scaled_query(num_heads * head_dim);
    for (int64_t seq = bounds[begin]; seq < bounds[end]; ++seq) {
      scores.resize(static_cast<size_t>(num_heads * lens[seq]));
      const float* seq_query = query_data + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) scaled_query[i] = seq_query[i] * scale_f;
      attend(scaled_query.data(), out_data + seq * num_heads * head_dim, cache_data,
             tables + seq * max_num_blocks, lens[seq], heads, layout, scores.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvpool_cpu, m) {
  m.def(
      "paged_decode(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpool_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
