// y = x Wᵀ over group-quantized weights for many tokens at once (a prefill): each thread
// dequantizes a tile of W's rows into x's dtype, transposed, and multiplies it with torch's own
// GEMM (oneDNN for bfloat16), then moves on. W is never expanded whole: a tile is at most
// `kTileBytes`, sized to stay in the core's L2 while every token passes over it.
//
//   dequant_matmul(x [M, K] float32|bfloat16, data uint8, bits, group, out_features N)
//       -> [M, N] (x's dtype)
//
// It multiplies what the dequantized model would (weights code · scale + min rounded to x's
// dtype, activations as they are): the accuracy of `quantization="none"`, at the cost of one
// dequantization per tile and call, which a few hundred tokens make negligible. Below that
// `quant_matmul`'s integer kernel is faster; `kvpool.kernels.quant_matmul` chooses.
//
// Work is split over tiles with at::parallel_for; the GEMM inside runs on its calling thread
// (OpenMP does not nest).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>

#include "quant_layout.h"

namespace {

using kvpool_quant::code_at;
using kvpool_quant::half_at;
using kvpool_quant::kPanel;
using kvpool_quant::PackedLayout;

constexpr int64_t kTileBytes = 512 << 10;  // a dequantized tile (128 KiB-1 MiB measured alike)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVPOOL_DEQUANT_VECTOR 1

inline void store16(float* at, __m512 values) { _mm512_storeu_ps(at, values); }
inline void store16(at::BFloat16* at, __m512 values) {  // rounds to nearest even, as torch
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), (__m256i)_mm512_cvtneps_pbh(values));
}

// One block (a panel's group) into `rows` (the tile row of the group's first k; `width` apart):
// a 64-byte load holds the panel's 16 rows × 4 codes (8-bit) or × 8 codes (4-bit), one row a
// 32-bit lane, so each code position is a shift and a mask away from 16 rows of one k.
template <int Bits, typename T>
void dequantize_block(const PackedLayout& w, const uint8_t* block, T* rows, int64_t width) {
  const __m512 scale = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + w.code_bytes)));
  const __m512 min = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + w.code_bytes + 2 * kPanel)));
  constexpr int kPerLoad = 32 / Bits;  // k a 64-byte load holds
  const __m512i mask = _mm512_set1_epi32((1 << Bits) - 1);
  for (int64_t k = 0; k < w.group; k += kPerLoad) {
    const __m512i codes = _mm512_loadu_si512(block + k * Bits * 2);
    for (int j = 0; j < kPerLoad; ++j) {
      // 8-bit: byte j is k + j; 4-bit: byte j % 4's low nibble is k + j, its high one k + 4 + j.
      const int shift = Bits == 8 ? 8 * j : 8 * (j % 4) + 4 * (j / 4);
      const __m512i code = _mm512_and_si512(_mm512_srli_epi32(codes, shift), mask);
      store16(rows + (k + j) * width, _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), scale, min));
    }
  }
}
#endif

// Panels [first, last) of W into the first columns of `tile` [K, width], weights in T.
template <int Bits, typename T>
void dequantize_panels(const PackedLayout& w, int64_t first, int64_t last, T* tile,
                       int64_t width) {
  for (int64_t panel = first; panel < last; ++panel)
    for (int64_t g = 0; g < w.groups(); ++g) {
      const uint8_t* block = w.block(panel, g);
      T* rows = tile + g * w.group * width + (panel - first) * kPanel;
#ifdef KVPOOL_DEQUANT_VECTOR
      dequantize_block<Bits>(w, block, rows, width);
#else
      for (int64_t lane = 0; lane < kPanel; ++lane) {
        const float scale = half_at(block + w.code_bytes, lane);
        const float min = half_at(block + w.code_bytes + 2 * kPanel, lane);
        for (int64_t k = 0; k < w.group; ++k)
          rows[k * width + lane] = static_cast<T>(code_at<Bits>(block, lane, k) * scale + min);
      }
#endif
    }
}

template <typename T>
at::Tensor matmul_typed(const at::Tensor& x, const PackedLayout& w, int64_t bits) {
  at::Tensor out = at::empty({x.size(0), w.rows}, x.options());
  const int64_t panels = w.panels();
  // Tiles of at most kTileBytes, as many as a multiple of the threads (each thread the same
  // share: 4 tiles against 3 cost an eighth of the time on two cores).
  const int64_t by_bytes = std::max<int64_t>(1, kTileBytes / (w.cols * kPanel * sizeof(T)));
  const int64_t threads = at::get_num_threads();
  const int64_t rounds = (panels + by_bytes * threads - 1) / (by_bytes * threads);
  const int64_t tile_panels = (panels + rounds * threads - 1) / (rounds * threads);
  const int64_t tiles = (panels + tile_panels - 1) / tile_panels;
  // The caller's inference mode is thread-local: the pool's threads take it on, or writing to
  // an inference tensor `out` there would be refused.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const c10::InferenceMode mode(inference);
    at::Tensor tile = at::empty({w.cols, tile_panels * kPanel}, x.options());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * tile_panels, last = std::min(panels, first + tile_panels);
      if (bits == 4)
        dequantize_panels<4>(w, first, last, tile.data_ptr<T>(), tile.size(1));
      else
        dequantize_panels<8>(w, first, last, tile.data_ptr<T>(), tile.size(1));
      const int64_t row = first * kPanel, count = std::min(w.rows, last * kPanel) - row;
      out.narrow(1, row, count).copy_(at::mm(x, tile.narrow(1, 0, count)));
    }
  });
  return out;
}

at::Tensor dequant_matmul(const at::Tensor& x, const at::Tensor& data, int64_t bits,
                          int64_t group, int64_t out_features) {
  const PackedLayout w = kvpool_quant::checked_layout(x, data, bits, group, out_features);
  switch (x.scalar_type()) {
    case at::kFloat: return matmul_typed<float>(x, w, bits);
    case at::kBFloat16: return matmul_typed<at::BFloat16>(x, w, bits);
    default: TORCH_CHECK(false, "dequant_matmul takes float32 or bfloat16 activations");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpool_cpu, m) {
  m.def("dequant_matmul(Tensor x, Tensor data, int bits, int group, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpool_cpu, CPU, m) { m.impl("dequant_matmul", &dequant_matmul); }
