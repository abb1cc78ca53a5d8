// y = x Wᵀ over group-quantized weights, multiplied as they are stored: 4- or 8-bit unsigned
// codes with a float16 (scale, min) per group of `group` weights along each row
// (`kvpool.kernels.group_quant`), never expanded to a float copy of W.
//
//   quant_matmul(x [M, K] float32|bfloat16, data uint8, bits, group, out_features N)
//       -> [M, N] (x's dtype)
//
// The activations are quantized on entry, per token and per weight group (the group of x
// matches W's, so one x scale holds across each integer dot product), in two int8 passes: a
// code and its rounding error in 16ths of a step:
//   xs[g] = max|x[g]| / 127,  xq = round(x / xs),  xr = round((x / xs - xq) · 16)
//   x ≈ xs · (xq + xr / 16)      (~12 bits; bfloat16 itself keeps 8)
//   y[n] = Σ_g  scale[n,g] · xs[g] / 16 · Σ_{k∈g} code[n,k] · (16 · xq[k] + xr[k])
//          + min[n,g] · Σ x[g]   (the exact float sum of the group)
// so the inner loop is integer multiply-adds of unsigned codes by signed activations: AVX-512
// VNNI's vpdpbusd, 64 of them an instruction, once for xq (by 16 · code: a 4-bit code's fits
// a byte) and once for xr, into the same sum. xq alone, one pass, cost SmolLM2 +1.3%
// perplexity in bfloat16 against +0.05% for both (docs/cpu_decode.md); it was also 1.6× faster
// from 32 tokens up, where this kernel now runs at about bfloat16 oneDNN's speed. The integer
// sum of a group is exact (|16 · Σ code · xq| < 2³¹ for groups up to 512); the float sum over
// groups runs in a fixed order, so results do not depend on the thread count.
//
// The layout is `quant_layout.h`'s: one 512-bit load is the 16 rows × 4 k that vpdpbusd
// multiplies by 4 broadcast bytes of x, so lanes are output rows and no horizontal sum is ever
// needed; and a panel is one sequential stream, scales included (with codes and scales in
// separate arrays a tile read a dozen streams and reached a third of the bandwidth one stream
// does on this machine's cold weights).
//
// A tile is up to 8 tokens × one panel: each unpacked weight vector serves 8 tokens, and each
// thread streams one run of memory (software prefetching, 256 B to 4 KiB ahead, changed nothing
// measurable; a tile of 8 tokens × 2 panels ran out of registers). Work is split over panels
// with at::parallel_for (torch's OpenMP pool). Without VNNI the same arithmetic runs as scalar
// C++ (`tests/kernels/test_quant_matmul_scalar.py` builds and checks it).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "quant_layout.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVPOOL_VNNI 1
#endif

namespace {

using kvpool_quant::code_at;
using kvpool_quant::half_at;
using kvpool_quant::kPanel;
using kvpool_quant::PackedLayout;

constexpr int64_t kPanelsPerTile = 1;  // 16 rows a tile
constexpr int64_t kTokensPerTile = 8;
constexpr int64_t kActivationBytes = 256 << 10;  // int8 activations a token chunk holds
constexpr int kResidualShift = 4;  // a residual counts 1 / 2⁴ of a code step: |xr| <= 8
constexpr int64_t kMaxGroup = 512;  // keeps 16 · Σ code · xq well within int32

// The activations, quantized per token and group. `packed` keeps each 8 k of all tokens
// together, token after token: the 8 codes, then the 8 residuals. A tile's tokens are then
// constant offsets from one pointer (with a pointer per token and pass, 8 tokens ran out of
// registers and spilled addresses in the inner loop).
constexpr int64_t kChunk = 8;  // k a packed chunk holds
struct QuantizedActivations {
  at::Tensor packed;  // int8 [K/8, M, 16]
  at::Tensor scales;  // float32 [M, K/G]
  at::Tensor sums;   // float32 [M, K/G]
};

// IEEE arithmetic here, whatever the file's flags: -ffast-math would turn amax / 127 into a
// multiplication by a rounded reciprocal, and x / scale landing on a tie (common for bfloat16
// inputs) would then round to another code than the PyTorch reference's.
#define KVPOOL_IEEE __attribute__((optimize("no-fast-math")))

KVPOOL_IEEE inline float inverse_of(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// x / xs as a code and a residual. scaled - code is exact (the two are within a factor of two,
// or code is 0) and so is the power-of-two product, so the rounding matches the reference's.
KVPOOL_IEEE inline void split(float scaled, int8_t* code, int8_t* residual) {
  const float rounded = std::nearbyint(scaled);
  *code = static_cast<int8_t>(rounded);
  *residual = static_cast<int8_t>(std::nearbyint((scaled - rounded) * (1 << kResidualShift)));
}

template <typename T>
KVPOOL_IEEE void quantize_group(const T* x, int64_t group, int8_t* codes, int8_t* residuals,
                                float* scale, float* sum) {
  float amax = 0.0f, total = 0.0f;
  for (int64_t k = 0; k < group; ++k) {
    const float value = static_cast<float>(x[k]);
    amax = std::max(amax, std::fabs(value));
    total += value;
  }
  *scale = amax / 127.0f;
  *sum = total;
  const float inverse = inverse_of(*scale);
  for (int64_t k = 0; k < group; ++k)
    split(static_cast<float>(x[k]) * inverse, codes + k, residuals + k);
}

#ifdef KVPOOL_VNNI
// The same, 16 lanes at a time (groups of a multiple of 16): a prefill quantizes a few
// hundred thousand activations a matmul, and scalar code cost down_proj a third of its time.
inline __m512 load_floats(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load_floats(const at::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename T>
KVPOOL_IEEE void quantize_group_vector(const T* x, int64_t group, int8_t* codes,
                                       int8_t* residuals, float* scale, float* sum) {
  __m512 amax = _mm512_setzero_ps(), total = _mm512_setzero_ps();
  for (int64_t k = 0; k < group; k += 16) {
    const __m512 value = load_floats(x + k);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(value));
    total = _mm512_add_ps(total, value);
  }
  *scale = _mm512_reduce_max_ps(amax) / 127.0f;
  *sum = _mm512_reduce_add_ps(total);
  const __m512 inverse = _mm512_set1_ps(inverse_of(*scale));
  for (int64_t k = 0; k < group; k += 16) {
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // ties to even
    const __m512 scaled = _mm512_mul_ps(load_floats(x + k), inverse);
    const __m512 rounded = _mm512_roundscale_ps(scaled, kNearest);
    const __m512 residual = _mm512_roundscale_ps(
        _mm512_mul_ps(_mm512_sub_ps(scaled, rounded), _mm512_set1_ps(1 << kResidualShift)),
        kNearest);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rounded)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(residuals + k),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(residual)));
  }
}
#endif

template <typename T>
void quantize_row(const T* x, int64_t cols, int64_t group, int8_t* codes, int8_t* residuals,
                  float* scales, float* sums) {
  for (int64_t start = 0, g = 0; start < cols; start += group, ++g) {
#ifdef KVPOOL_VNNI
    if (group % 16 == 0) {
      quantize_group_vector(x + start, group, codes + start, residuals + start, scales + g,
                            sums + g);
      continue;
    }
#endif
    quantize_group(x + start, group, codes + start, residuals + start, scales + g, sums + g);
  }
}

template <typename T>
QuantizedActivations quantize_activations(const at::Tensor& x, int64_t group) {
  const int64_t rows = x.size(0), cols = x.size(1), groups = cols / group;
  QuantizedActivations q{at::empty({cols / kChunk, rows, 2 * kChunk}, x.options().dtype(at::kChar)),
                         at::empty({rows, groups}, x.options().dtype(at::kFloat)),
                         at::empty({rows, groups}, x.options().dtype(at::kFloat))};
  const T* data = x.data_ptr<T>();
  const int64_t stride = x.stride(0);
  int8_t* packed = q.packed.data_ptr<int8_t>();
  float* scales = q.scales.data_ptr<float>();
  float* sums = q.sums.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / cols), [&](int64_t begin, int64_t end) {
    std::vector<int8_t> codes(cols), residuals(cols);  // one row's, before packing
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(data + m * stride, cols, group, codes.data(), residuals.data(),
                   scales + m * groups, sums + m * groups);
      for (int64_t chunk = 0; chunk < cols / kChunk; ++chunk) {
        int8_t* at = packed + (chunk * rows + m) * 2 * kChunk;
        std::memcpy(at, codes.data() + chunk * kChunk, kChunk);
        std::memcpy(at + kChunk, residuals.data() + chunk * kChunk, kChunk);
      }
    }
  });
  return q;
}

// Where a tile reads and writes: the weights of its panels and its tokens' activations.
struct Operands : PackedLayout {
  const int8_t* x_packed;
  const float* x_scales;
  const float* x_sums;
  int64_t tokens;  // M
  // The packed codes and residuals of `token` for the 8 k from k (a multiple of 8).
  const int8_t* x_chunk(int64_t k, int64_t token) const {
    return x_packed + ((k / kChunk) * tokens + token) * 2 * kChunk;
  }
};

template <typename Out>
void store_row(Out* out, const float* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<Out>(values[i]);
}

#ifdef KVPOOL_VNNI

// The 16 rows × 8 k of codes at k (a multiple of 8) in one panel, as vectors of 16 rows × 4 k
// (quads k/4 and k/4 + 1), each as the codes' pass multiplies it (`codes`: 16 · code for 4-bit
// codes, code for 8-bit ones) and as the residuals' pass does (`plain`: code).
template <int Bits>
inline void load_codes(const uint8_t* block, int64_t k, __m512i codes[2], __m512i plain[2]) {
  const uint8_t* at = block + k * Bits * 2;
  if constexpr (Bits == 4) {
    const __m512i packed = _mm512_loadu_si512(at);
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
    plain[0] = _mm512_and_si512(packed, low);
    plain[1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    codes[0] = _mm512_and_si512(_mm512_slli_epi16(packed, 4), high);
    codes[1] = _mm512_and_si512(packed, high);
  } else {
    codes[0] = plain[0] = _mm512_loadu_si512(at);
    codes[1] = plain[1] = _mm512_loadu_si512(at + 64);
  }
}

inline __m512 load_halves(const uint8_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// sum += codes · the four int8 activations at x, broadcast to every lane. (Written in assembly
// with the broadcast folded into vpdpbusd's memory operand it measured the same.)
using unaligned_int32 = int32_t __attribute__((may_alias, aligned(1)));
inline void dot_four(__m512i& sum, __m512i codes, const int8_t* x) {
  sum = _mm512_dpbusd_epi32(sum, codes,
                            _mm512_set1_epi32(*reinterpret_cast<const unaligned_int32*>(x)));
}

// One tile: T tokens (from `token`) × R panels (from `panel`), written to out rows.
template <int Bits, int T, int R, typename Out>
void tile(const Operands& op, int64_t panel, int64_t token, Out* out, int64_t out_stride) {
  const int64_t groups = op.groups();
  // Each row's sum of a group, in residual steps: Σ code · (16 · xq + xr). 16 · a 4-bit code
  // fits a byte, so both passes add into one sum; 8-bit codes keep the codes' pass apart and
  // shift it at the end. A single token splits each pass into two chains (even and odd
  // quads): vpdpbusd's latency, not the memory bus, would otherwise bound a batch-1 step.
  constexpr int S = T == 1 ? 2 : 1;                    // chains a pass
  constexpr int P = Bits == 4 && T > 1 ? 1 : 2;         // passes summed apart
  constexpr int kResidualChain = (P - 1) * S;           // the residuals' pass's first chain
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sum[S * P][T][R];
    for (int c = 0; c < S * P; ++c)
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) sum[c][t][r] = _mm512_setzero_si512();
    const uint8_t* block[R];
    for (int r = 0; r < R; ++r) block[r] = op.block(panel + r, g);
    for (int64_t k = 0; k < op.group; k += 8) {
      __m512i codes[R][2], plain[R][2];
      for (int r = 0; r < R; ++r) load_codes<Bits>(block[r], k, codes[r], plain[r]);
      const int8_t* chunk = op.x_chunk(g * op.group + k, token);
      for (int t = 0; t < T; ++t) {
        const int8_t* at = chunk + t * 2 * kChunk;
        for (int q = 0; q < 2; ++q)  // the two quads
          for (int r = 0; r < R; ++r) {
            dot_four(sum[q * (S - 1)][t][r], codes[r][q], at + 4 * q);
            dot_four(sum[kResidualChain + q * (S - 1)][t][r], plain[r][q], at + kChunk + 4 * q);
          }
      }
    }
    __m512 scale[R], min[R];
    for (int r = 0; r < R; ++r) {
      scale[r] = load_halves(block[r] + op.code_bytes);
      min[r] = load_halves(block[r] + op.code_bytes + 2 * kPanel);
    }
    for (int t = 0; t < T; ++t) {
      const __m512 x_step = _mm512_set1_ps(op.x_scales[(token + t) * groups + g] *
                                           (1.0f / (1 << kResidualShift)));
      const __m512 x_sum = _mm512_set1_ps(op.x_sums[(token + t) * groups + g]);
      for (int r = 0; r < R; ++r) {
        __m512i steps = sum[0][t][r];  // Σ code · (16 · xq + xr)
        for (int c = 1; c < S; ++c) steps = _mm512_add_epi32(steps, sum[c][t][r]);
        if constexpr (Bits == 8) steps = _mm512_slli_epi32(steps, kResidualShift);
        for (int c = S; c < S * P; ++c) steps = _mm512_add_epi32(steps, sum[c][t][r]);
        acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(steps), _mm512_mul_ps(scale[r], x_step),
                                    acc[t][r]);
        acc[t][r] = _mm512_fmadd_ps(min[r], x_sum, acc[t][r]);
      }
    }
  }
  alignas(64) float values[kPanel];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      const int64_t row = (panel + r) * kPanel;
      _mm512_store_ps(values, acc[t][r]);
      store_row(out + (token + t) * out_stride + row, values,
                std::min<int64_t>(kPanel, op.rows - row));
    }
}

// Tokens [begin, end) through R panels, 8 tokens a tile, then 4, 2 and 1.
template <int Bits, int R, typename Out>
void tokens(const Operands& op, int64_t panel, int64_t begin, int64_t end, Out* out,
            int64_t stride) {
  static_assert(kTokensPerTile == 8, "the remainder below is split into 4, 2 and 1");
  int64_t token = begin;
  for (; token + kTokensPerTile <= end; token += kTokensPerTile)
    tile<Bits, kTokensPerTile, R>(op, panel, token, out, stride);
  const int64_t left = end - token;
  if (left & 4) tile<Bits, 4, R>(op, panel, token, out, stride), token += 4;
  if (left & 2) tile<Bits, 2, R>(op, panel, token, out, stride), token += 2;
  if (left & 1) tile<Bits, 1, R>(op, panel, token, out, stride);
}

// Panels [begin, end) × tokens [token_begin, token_end).
template <int Bits, typename Out>
void panels(const Operands& op, int64_t begin, int64_t end, int64_t token_begin,
            int64_t token_end, Out* out, int64_t stride) {
  int64_t panel = begin;
  if (token_end - token_begin == 1) {  // one panel at a time: a single sequential stream
    for (; panel < end; ++panel) tile<Bits, 1, 1>(op, panel, token_begin, out, stride);
    return;
  }
  for (; panel + kPanelsPerTile <= end; panel += kPanelsPerTile)
    tokens<Bits, kPanelsPerTile>(op, panel, token_begin, token_end, out, stride);
  if (panel < end) tokens<Bits, 1>(op, panel, token_begin, token_end, out, stride);
}

#else  // the same arithmetic, scalar

template <int Bits, typename Out>
void panels(const Operands& op, int64_t begin, int64_t end, int64_t token_begin,
            int64_t token_end, Out* out, int64_t stride) {
  const int64_t groups = op.groups();
  float values[kPanel];
  for (int64_t panel = begin; panel < end; ++panel)
    for (int64_t m = token_begin; m < token_end; ++m) {
      for (int64_t lane = 0; lane < kPanel; ++lane) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* block = op.block(panel, g);
          int32_t steps = 0;
          for (int64_t k = g * op.group; k < (g + 1) * op.group; ++k) {
            const int8_t* chunk = op.x_chunk(k, m);
            steps += code_at<Bits>(block, lane, k - g * op.group) *
                     (chunk[k % kChunk] * (1 << kResidualShift) + chunk[kChunk + k % kChunk]);
          }
          const float x_step = op.x_scales[m * groups + g] * (1.0f / (1 << kResidualShift));
          acc += static_cast<float>(steps) * (half_at(block + op.code_bytes, lane) * x_step);
          acc += half_at(block + op.code_bytes + 2 * kPanel, lane) * op.x_sums[m * groups + g];
        }
        values[lane] = acc;
      }
      const int64_t row = panel * kPanel;
      store_row(out + m * stride + row, values, std::min<int64_t>(kPanel, op.rows - row));
    }
}

#endif

template <typename T>
at::Tensor matmul_typed(const at::Tensor& x, const PackedLayout& w, int64_t bits) {
  const QuantizedActivations q = quantize_activations<T>(x, w.group);
  const int64_t num_tokens = x.size(0), rows = w.rows;
  at::Tensor out = at::empty({num_tokens, rows}, x.options());
  const Operands op{w, q.packed.data_ptr<int8_t>(), q.scales.data_ptr<float>(),
                    q.sums.data_ptr<float>(), num_tokens};
  T* out_data = out.data_ptr<T>();
  const int64_t num_panels = w.panels();
  const int64_t num_tiles = (num_panels + kPanelsPerTile - 1) / kPanelsPerTile;
  // Tokens in chunks whose int8 activations stay in L2 while a thread's panels pass over them
  // (the whole batch, up to kActivationBytes): a prefill's 512 × 1536 activations did not,
  // and down_proj ran at 80 against bf16's 200 GMAC/s.
  const int64_t chunk = std::max<int64_t>(kTokensPerTile, kActivationBytes / x.size(1));
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * kPanelsPerTile;
    const int64_t last = std::min(num_panels, end * kPanelsPerTile);
    for (int64_t token = 0; token < num_tokens; token += chunk) {
      const int64_t token_end = std::min(num_tokens, token + chunk);
      if (bits == 4)
        panels<4>(op, first, last, token, token_end, out_data, rows);
      else
        panels<8>(op, first, last, token, token_end, out_data, rows);
    }
  });
  return out;
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& data, int64_t bits, int64_t group,
                        int64_t out_features) {
  const PackedLayout w = kvpool_quant::checked_layout(x, data, bits, group, out_features);
  TORCH_CHECK(group <= kMaxGroup, "the group must be at most ", kMaxGroup);
  switch (x.scalar_type()) {
    case at::kFloat: return matmul_typed<float>(x, w, bits);
    case at::kBFloat16: return matmul_typed<at::BFloat16>(x, w, bits);
    default: TORCH_CHECK(false, "quant_matmul takes float32 or bfloat16 activations");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpool_cpu, m) {
  m.def("quant_matmul(Tensor x, Tensor data, int bits, int group, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpool_cpu, CPU, m) { m.impl("quant_matmul", &quant_matmul); }
