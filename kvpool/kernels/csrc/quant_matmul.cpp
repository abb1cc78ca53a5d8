// y = x Wᵀ over group-quantized weights, multiplied as they are stored: 4- or 8-bit unsigned
// codes with a float16 (scale, min) per group of `group` weights along each row
// (`kvpool.kernels.group_quant`), never expanded to a float copy of W.
//
//   quant_matmul(x [M, K] float32|bfloat16, data uint8, bits, group, out_features N)
//       -> [M, N] (x's dtype)
//
// The activations are quantized on entry, per token and per weight group (the group of x
// matches W's, so one x scale holds across each integer dot product):
//   xs[g] = max|x[g]| / 127,  xq = round(x / xs) int8,  xsum[g] = Σ x[g] (exact, float)
//   y[n] = Σ_g  scale[n,g] · xs[g] · Σ_{k∈g} code[n,k] · xq[k]  +  min[n,g] · xsum[g]
// so the inner loop is integer multiply-adds of unsigned codes by signed activations: AVX-512
// VNNI's vpdpbusd, 64 of them an instruction. The integer sum of a group is exact; the float
// sum over groups runs in a fixed order, so results do not depend on the thread count.
//
// Layout (`kvpool.kernels.quant_matmul.pack` writes it): rows in panels of 16 (N padded with
// zero rows); each panel a run of groups, each group one block of its codes followed by its
// float16 scales and mins:
//   block(p, g) = codes | scales[16] | mins[16]      G·16·bits/8 + 64 bytes
//   codes, 8-bit: [k/4][n%16][k%4]  (k within the group)
//   codes, 4-bit: [k/8][j], j = (n%16)·4 + k%4: the low nibble holds k/8·8 + k%4, the high
//                 nibble k/8·8 + 4 + k%4
// One 512-bit load is then the 16 rows × 4 k that vpdpbusd multiplies by 4 broadcast bytes of
// x: lanes are output rows, so no horizontal sum is ever needed. And a panel is one sequential
// stream, scales included: with codes and scales in separate arrays a tile read a dozen streams
// and reached a third of the bandwidth one stream does on this machine's cold weights.
//
// A tile of up to 4 tokens × 2 panels shares each unpacked weight vector, so at larger batches
// the kernel reuses W from cache; a single token reads one panel at a time, so that each
// thread streams one run of memory (software prefetching, 256 B to 4 KiB ahead, changed
// nothing measurable). Work is split over panels with at::parallel_for (torch's OpenMP pool).
// Without VNNI the same arithmetic runs as scalar C++.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVPOOL_VNNI 1
#endif

namespace {

constexpr int64_t kPanel = 16;        // rows a panel
constexpr int64_t kPanelsPerTile = 2;  // 32 rows a tile
constexpr int64_t kTokensPerTile = 4;
constexpr int64_t kActivationBytes = 256 << 10;  // int8 activations a token chunk holds

// The activations, quantized per token and group.
struct QuantizedActivations {
  at::Tensor codes;  // int8 [M, K]
  at::Tensor scales;  // float32 [M, K/G]
  at::Tensor sums;   // float32 [M, K/G]
};

// IEEE arithmetic here, whatever the file's flags: -ffast-math would turn amax / 127 into a
// multiplication by a rounded reciprocal, and x / scale landing on a tie (common for bfloat16
// inputs) would then round to another code than the PyTorch reference's.
#define KVPOOL_IEEE __attribute__((optimize("no-fast-math")))

KVPOOL_IEEE inline float inverse_of(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

template <typename T>
KVPOOL_IEEE void quantize_group(const T* x, int64_t group, int8_t* codes, float* scale,
                                float* sum) {
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
    codes[k] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[k]) * inverse));
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
KVPOOL_IEEE void quantize_group_vector(const T* x, int64_t group, int8_t* codes, float* scale,
                                       float* sum) {
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
    const __m512 scaled = _mm512_mul_ps(load_floats(x + k), inverse);
    const __m512i rounded = _mm512_cvtps_epi32(  // ties to even, as nearbyint
        _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k), _mm512_cvtsepi32_epi8(rounded));
  }
}
#endif

template <typename T>
void quantize_row(const T* x, int64_t cols, int64_t group, int8_t* codes, float* scales,
                  float* sums) {
  for (int64_t start = 0, g = 0; start < cols; start += group, ++g) {
#ifdef KVPOOL_VNNI
    if (group % 16 == 0) {
      quantize_group_vector(x + start, group, codes + start, scales + g, sums + g);
      continue;
    }
#endif
    quantize_group(x + start, group, codes + start, scales + g, sums + g);
  }
}

template <typename T>
QuantizedActivations quantize_activations(const at::Tensor& x, int64_t group) {
  const int64_t rows = x.size(0), cols = x.size(1), groups = cols / group;
  QuantizedActivations q{at::empty({rows, cols}, x.options().dtype(at::kChar)),
                         at::empty({rows, groups}, x.options().dtype(at::kFloat)),
                         at::empty({rows, groups}, x.options().dtype(at::kFloat))};
  const T* data = x.data_ptr<T>();
  const int64_t stride = x.stride(0);
  int8_t* codes = q.codes.data_ptr<int8_t>();
  float* scales = q.scales.data_ptr<float>();
  float* sums = q.sums.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / cols), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(data + m * stride, cols, group, codes + m * cols, scales + m * groups,
                   sums + m * groups);
  });
  return q;
}

// Where a tile reads and writes: the weights of its panels and its tokens' activations.
struct Operands {
  const uint8_t* data;
  const int8_t* x_codes;
  const float* x_scales;
  const float* x_sums;
  int64_t cols, group, rows;  // K, G, N (unpadded)
  int64_t code_bytes;         // a block's codes: G·16·bits/8
  int64_t groups() const { return cols / group; }
  int64_t block_bytes() const { return code_bytes + 4 * kPanel; }
  const uint8_t* block(int64_t panel, int64_t g) const {
    return data + (panel * groups() + g) * block_bytes();
  }
};

template <typename Out>
void store_row(Out* out, const float* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<Out>(values[i]);
}

#ifdef KVPOOL_VNNI

// The 16 rows × 8 k of codes at k (a multiple of 8) in one panel, as two vectors of 16 rows ×
// 4 k: quad k/4 and quad k/4 + 1.
template <int Bits>
inline void load_codes(const uint8_t* block, int64_t k, __m512i& first, __m512i& second) {
  const uint8_t* at = block + k * Bits * 2;
  if constexpr (Bits == 4) {
    const __m512i packed = _mm512_loadu_si512(at);
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    first = _mm512_and_si512(packed, low_nibbles);
    second = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
  } else {
    first = _mm512_loadu_si512(at);
    second = _mm512_loadu_si512(at + 64);
  }
}

inline __m512 load_halves(const uint8_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

inline int32_t four_codes(const int8_t* x) {
  int32_t value;
  std::memcpy(&value, x, sizeof(value));
  return value;
}

// One tile: T tokens (from `token`) × R panels (from `panel`), written to out rows.
template <int Bits, int T, int R, typename Out>
void tile(const Operands& op, int64_t panel, int64_t token, Out* out, int64_t out_stride) {
  const int64_t groups = op.groups();
  // A single token gives each row's sum its own two chains (even and odd quads): vpdpbusd's
  // latency, not the memory bus, would otherwise bound a batch-1 step.
  constexpr int S = T == 1 ? 2 : 1;
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[S][T][R];
    for (int c = 0; c < S; ++c)
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) dot[c][t][r] = _mm512_setzero_si512();
    const uint8_t* block[R];
    for (int r = 0; r < R; ++r) block[r] = op.block(panel + r, g);
    for (int64_t k = 0; k < op.group; k += 8) {
      __m512i first[R], second[R];
      for (int r = 0; r < R; ++r) load_codes<Bits>(block[r], k, first[r], second[r]);
      for (int t = 0; t < T; ++t) {
        const int8_t* x = op.x_codes + (token + t) * op.cols + g * op.group + k;
        const __m512i x_first = _mm512_set1_epi32(four_codes(x));
        const __m512i x_second = _mm512_set1_epi32(four_codes(x + 4));
        for (int r = 0; r < R; ++r) {
          dot[0][t][r] = _mm512_dpbusd_epi32(dot[0][t][r], first[r], x_first);
          dot[S - 1][t][r] = _mm512_dpbusd_epi32(dot[S - 1][t][r], second[r], x_second);
        }
      }
    }
    if constexpr (S == 2)
      for (int r = 0; r < R; ++r) dot[0][0][r] = _mm512_add_epi32(dot[0][0][r], dot[1][0][r]);
    __m512 scale[R], min[R];
    for (int r = 0; r < R; ++r) {
      scale[r] = load_halves(block[r] + op.code_bytes);
      min[r] = load_halves(block[r] + op.code_bytes + 2 * kPanel);
    }
    for (int t = 0; t < T; ++t) {
      const __m512 x_scale = _mm512_set1_ps(op.x_scales[(token + t) * groups + g]);
      const __m512 x_sum = _mm512_set1_ps(op.x_sums[(token + t) * groups + g]);
      for (int r = 0; r < R; ++r) {
        acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0][t][r]),
                                    _mm512_mul_ps(scale[r], x_scale), acc[t][r]);
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

// Tokens [begin, end) through R panels, 4 tokens a tile.
template <int Bits, int R, typename Out>
void tokens(const Operands& op, int64_t panel, int64_t begin, int64_t end, Out* out,
            int64_t stride) {
  int64_t token = begin;
  for (; token + kTokensPerTile <= end; token += kTokensPerTile)
    tile<Bits, kTokensPerTile, R>(op, panel, token, out, stride);
  switch (end - token) {
    case 3: tile<Bits, 3, R>(op, panel, token, out, stride); break;
    case 2: tile<Bits, 2, R>(op, panel, token, out, stride); break;
    case 1: tile<Bits, 1, R>(op, panel, token, out, stride); break;
    default: break;
  }
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

// The code of row `lane` at k (within the group) in a block.
template <int Bits>
inline int code_at(const uint8_t* block, int64_t lane, int64_t k) {
  if constexpr (Bits == 4) {
    const uint8_t byte = block[(k / 8) * 64 + lane * 4 + k % 4];
    return (k % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
  } else {
    return block[(k / 4) * 64 + lane * 4 + k % 4];
  }
}

inline float half_at(const uint8_t* at, int64_t lane) {
  at::Half value;
  std::memcpy(&value, at + 2 * lane, sizeof(value));
  return static_cast<float>(value);
}

template <int Bits, typename Out>
void panels(const Operands& op, int64_t begin, int64_t end, int64_t token_begin,
            int64_t token_end, Out* out, int64_t stride) {
  const int64_t groups = op.groups();
  float values[kPanel];
  for (int64_t panel = begin; panel < end; ++panel)
    for (int64_t m = token_begin; m < token_end; ++m) {
      const int8_t* x = op.x_codes + m * op.cols;
      for (int64_t lane = 0; lane < kPanel; ++lane) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* block = op.block(panel, g);
          int32_t dot = 0;
          for (int64_t k = 0; k < op.group; ++k)
            dot += code_at<Bits>(block, lane, k) * x[g * op.group + k];
          const float scale = half_at(block + op.code_bytes, lane);
          acc += static_cast<float>(dot) * (scale * op.x_scales[m * groups + g]);
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
at::Tensor matmul_typed(const at::Tensor& x, const at::Tensor& data, int64_t bits, int64_t group,
                        int64_t rows) {
  const QuantizedActivations q = quantize_activations<T>(x, group);
  const int64_t num_tokens = x.size(0);
  at::Tensor out = at::empty({num_tokens, rows}, x.options());
  const Operands op{data.data_ptr<uint8_t>(), q.codes.data_ptr<int8_t>(),
                    q.scales.data_ptr<float>(), q.sums.data_ptr<float>(),
                    x.size(1), group, rows, group * kPanel * bits / 8};
  T* out_data = out.data_ptr<T>();
  const int64_t num_panels = (rows + kPanel - 1) / kPanel;
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
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D, contiguous in its last dimension");
  const int64_t cols = x.size(1);
  TORCH_CHECK(group % 8 == 0 && cols % group == 0, "the group must be a multiple of 8 dividing K");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous(), "data must be uint8");
  const int64_t num_panels = (out_features + kPanel - 1) / kPanel;
  const int64_t block_bytes = group * kPanel * bits / 8 + 4 * kPanel;
  TORCH_CHECK(data.numel() == num_panels * (cols / group) * block_bytes,
              "data does not hold ", out_features, " rows of ", cols, " ", bits,
              "-bit codes in groups of ", group);
  switch (x.scalar_type()) {
    case at::kFloat: return matmul_typed<float>(x, data, bits, group, out_features);
    case at::kBFloat16: return matmul_typed<at::BFloat16>(x, data, bits, group, out_features);
    default: TORCH_CHECK(false, "quant_matmul takes float32 or bfloat16 activations");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpool_cpu, m) {
  m.def("quant_matmul(Tensor x, Tensor data, int bits, int group, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpool_cpu, CPU, m) { m.impl("quant_matmul", &quant_matmul); }
