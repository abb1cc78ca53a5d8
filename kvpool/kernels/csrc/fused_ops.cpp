// The model's elementwise work, fused: one pass over the data per op instead of one per torch
// operator (an RMSNorm alone is seven of them, a rotary embedding six), and one dispatch.
//
// A decode step at small batch sizes spent about half its time in such small operators and
// their Python dispatch; a prefill step spent ~12% re-reading activations between them.
//
// Every op computes in float32 and rounds to the tensors' dtype exactly where the PyTorch
// formulation it replaces rounds (`kvpool.kernels.fused` holds that formulation: it is the
// reference these ops are tested against, and the fallback on other devices), so a bfloat16
// model produces the same values either way and float32 differs only in summation order.
// The KV quantizer is exact: its codes and scales equal the reference's bit for bit.
//
//   rms_norm(x [T, H], weight [H], eps) -> [T, H]
//       w * round(x * rsqrt(mean(x^2) + eps))
//   add_rms_norm_(x [T, H], residual [T, H], weight [H], eps)            (both in place)
//       residual = round(residual + x); x = rms_norm(residual)
//   silu_and_mul(x [T, 2I]) -> [T, I]
//       round(round(silu(gate)) * up), gate = x[:, :I], up = x[:, I:]
//   rotary_(x [T, N, D], positions [T] int64, cos [P, D], sin [P, D])   (in place)
//       "rotate half": x = round(round(x * c) + round(rotate_half(x) * s)), c/s rounded first
//   write_kv_(kv_layer [B, 2, S, Hkv, D], key [T, Hkv, D], value [T, Hkv, D], slots [T] int64)
//       kv_layer[slot / S, 0 or 1, slot % S] = key, value   (converted to the cache dtype)
//   write_kv_quantized_(kv_layer [B, 2, S, Hkv, D], kv_scales [B, 2, S, Hkv], key, value, slots)
//       the same slots, quantized (`kvpool.memory.kv_quant.quantize`): per K or V row of a KV
//       head, scale = amax(|row|) / qmax (1 for an all-zero row), code = round(row / scale)
//       clamped to ±qmax; codes int8 or float8 (e4m3fn, e5m2), scales float32
//
// Rows may be strided (q, k and v are views into the fused qkv output); the last dimension must
// be contiguous. Work is split over tokens with at::parallel_for, on torch's own OpenMP pool; a
// small batch runs on the calling thread, where forking threads would cost more than the work.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace {

// Rounds a float32 to the storage dtype T and back: what a PyTorch op on T tensors does to each
// result it writes.
template <typename T>
inline float round_to(float value) {
  return static_cast<float>(static_cast<T>(value));
}
template <>
inline float round_to<float>(float value) {
  return value;
}

// Tokens per parallel chunk: about `kGrainElements` elements of work each, so that a decode
// step's few rows stay on one thread.
constexpr int64_t kGrainElements = 1 << 15;
inline int64_t grain(int64_t elements_per_token) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_token));
}

void check_rows(const at::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.dim() == dims, name, " must be ", dims, "-D");
  TORCH_CHECK(t.stride(dims - 1) == 1, name, " must be contiguous in its last dimension");
}

template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t hidden, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < hidden; ++i) {
    const float value = static_cast<float>(x[i]);
    sum += value * value;
  }
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i)
    out[i] = static_cast<T>(static_cast<float>(weight[i]) *
                            round_to<T>(static_cast<float>(x[i]) * inverse));
}

template <typename T>
void rms_norm_typed(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  const T* x_data = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, num_tokens, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rms_norm_row(x_data + t * x_stride, w, out_data + t * out_stride, hidden,
                   static_cast<float>(eps));
  });
}

template <typename T>
void add_rms_norm_typed(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  T* x_data = x.data_ptr<T>();
  T* r_data = residual.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
  at::parallel_for(0, num_tokens, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = x_data + t * x_stride;
      T* stream = r_data + t * r_stride;
      for (int64_t i = 0; i < hidden; ++i)
        stream[i] = static_cast<T>(static_cast<float>(stream[i]) + static_cast<float>(row[i]));
      rms_norm_row(stream, w, row, hidden, static_cast<float>(eps));
    }
  });
}

template <typename T>
void silu_and_mul_typed(const at::Tensor& x, at::Tensor& out) {
  const int64_t num_tokens = x.size(0), half = x.size(1) / 2;
  const T* x_data = x.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, num_tokens, grain(2 * half), [&](int64_t begin, int64_t end) {
    std::vector<float> silu(half);  // float32 scratch, so the exp loop vectorises
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = x_data + t * x_stride;
      const T* up = gate + half;
      T* row = out_data + t * out_stride;
      for (int64_t i = 0; i < half; ++i) silu[i] = static_cast<float>(gate[i]);
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) silu[i] = silu[i] / (1.0f + std::exp(-silu[i]));
      for (int64_t i = 0; i < half; ++i)
        row[i] = static_cast<T>(round_to<T>(silu[i]) * static_cast<float>(up[i]));
    }
  });
}

template <typename T>
void rotary_typed(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                  const at::Tensor& sin) {
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), head_dim = x.size(2);
  const int64_t half = head_dim / 2;
  T* x_data = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_data = cos.data_ptr<float>();
  const float* sin_data = sin.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const int64_t table_stride = cos.stride(0);
  at::parallel_for(0, num_tokens, grain(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> c(head_dim), s(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < head_dim; ++i) {  // the cache rounded to T, as the model casts it
        c[i] = round_to<T>(cos_data[pos[t] * table_stride + i]);
        s[i] = round_to<T>(sin_data[pos[t] * table_stride + i]);
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        T* row = x_data + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(row[i]), x2 = static_cast<float>(row[i + half]);
          const float first = round_to<T>(x1 * c[i]) + round_to<T>(-x2 * s[i]);
          const float second = round_to<T>(x2 * c[i + half]) + round_to<T>(x1 * s[i + half]);
          row[i] = static_cast<T>(first);
          row[i + half] = static_cast<T>(second);
        }
      }
    }
  });
}

template <typename C, typename T>
void write_kv_typed(at::Tensor& kv_layer, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slots) {
  const int64_t num_tokens = key.size(0), num_heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = kv_layer.size(2), num_blocks = kv_layer.size(0);
  C* cache = kv_layer.data_ptr<C>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_blocks * block_size, "slot out of range");
  at::parallel_for(0, num_tokens, grain(2 * num_heads * head_dim), [&](int64_t begin,
                                                                       int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      C* base = cache + (slot[t] / block_size) * kv_layer.stride(0) +
                (slot[t] % block_size) * kv_layer.stride(2);
      for (int64_t h = 0; h < num_heads; ++h) {
        const T* k_row = k + t * key.stride(0) + h * key.stride(1);
        const T* v_row = v + t * value.stride(0) + h * value.stride(1);
        C* k_dst = base + h * kv_layer.stride(3);
        C* v_dst = k_dst + kv_layer.stride(1);
        for (int64_t i = 0; i < head_dim; ++i) {
          k_dst[i] = static_cast<C>(static_cast<float>(k_row[i]));
          v_dst[i] = static_cast<C>(static_cast<float>(v_row[i]));
        }
      }
    }
  });
}

// A quantized code type C: its largest code (`QUANTIZED_CODE_MAX` in kvpool.memory.kv_layout),
// and the code of an element already divided by its row's scale, rounded as the reference
// rounds: int8 to nearest even (nearbyint in the default rounding mode), then clamped; float8
// clamped, then converted by c10's constructor (nearest even), which is what torch's
// `.to(float8)` runs.
template <typename C>
struct Code;
template <>
struct Code<int8_t> {
  static constexpr float kMax = 127.0f;
  static int8_t encode(float x) {
    return static_cast<int8_t>(std::clamp(std::nearbyint(x), -kMax, kMax));
  }
};
template <>
struct Code<c10::Float8_e4m3fn> {
  static constexpr float kMax = 448.0f;
  static c10::Float8_e4m3fn encode(float x) {
    return c10::Float8_e4m3fn(std::clamp(x, -kMax, kMax));
  }
};
template <>
struct Code<c10::Float8_e5m2> {
  static constexpr float kMax = 57344.0f;
  static c10::Float8_e5m2 encode(float x) { return c10::Float8_e5m2(std::clamp(x, -kMax, kMax)); }
};

// a / b rounded once, as the reference divides. Under -ffast-math the compiler may turn a plain
// `x / scale` into `x * (1 / scale)` (and `amax / 127` into `amax * (1 / 127)`), which rounds
// differently; the division instruction's intrinsic is opaque to that rewrite (AVX-512's
// explicitly rounded form, or SSE's). Other targets get the plain division.
inline float exact_divide(float a, float b) {
#if defined(__AVX512F__)
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(a), _mm_set_ss(b), kNearest));
#elif defined(__SSE__)
  return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b)));
#else
  return a / b;
#endif
}

// Quantizes one row into `codes` and returns its scale, as `kv_quant.quantize` does.
template <typename C, typename T>
inline float quantize_row(const T* row, C* codes, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(row[i])));
  const float scale = amax > 0.0f ? exact_divide(amax, Code<C>::kMax) : 1.0f;
  for (int64_t i = 0; i < n; ++i)
    codes[i] = Code<C>::encode(exact_divide(static_cast<float>(row[i]), scale));
  return scale;
}

template <typename C, typename T>
void write_kv_quantized_typed(at::Tensor& kv_layer, at::Tensor& kv_scales, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& slots) {
  const int64_t num_tokens = key.size(0), num_heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = kv_layer.size(2), num_blocks = kv_layer.size(0);
  C* cache = kv_layer.data_ptr<C>();
  float* scales = kv_scales.data_ptr<float>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_blocks * block_size, "slot out of range");
  at::parallel_for(0, num_tokens, grain(2 * num_heads * head_dim), [&](int64_t begin,
                                                                       int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      C* base = cache + block * kv_layer.stride(0) + offset * kv_layer.stride(2);
      float* scale_base = scales + block * kv_scales.stride(0) + offset * kv_scales.stride(2);
      for (int64_t h = 0; h < num_heads; ++h) {
        C* k_codes = base + h * kv_layer.stride(3);
        C* v_codes = k_codes + kv_layer.stride(1);
        float* k_scale = scale_base + h * kv_scales.stride(3);
        float* v_scale = k_scale + kv_scales.stride(1);
        *k_scale = quantize_row(k + t * key.stride(0) + h * key.stride(1), k_codes, head_dim);
        *v_scale = quantize_row(v + t * value.stride(0) + h * value.stride(1), v_codes, head_dim);
      }
    }
  });
}

// Calls body<T>() for the float dtype of `t` (float32, bfloat16 or float16).
template <typename Body>
void dispatch_float(const at::Tensor& t, const char* op, Body&& body) {
  switch (t.scalar_type()) {
    case at::kFloat: return body(float{});
    case at::kBFloat16: return body(c10::BFloat16{});
    case at::kHalf: return body(c10::Half{});
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16 only");
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, 2, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [hidden] tensor of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_float(x, "rms_norm", [&](auto tag) {
    rms_norm_typed<decltype(tag)>(x, weight, eps, out);
  });
  return out;
}

void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, 2, "x");
  check_rows(residual, 2, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must have one shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [hidden] tensor of x's dtype");
  dispatch_float(x, "add_rms_norm_", [&](auto tag) {
    add_rms_norm_typed<decltype(tag)>(x, residual, weight, eps);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, 2, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch_float(x, "silu_and_mul", [&](auto tag) { silu_and_mul_typed<decltype(tag)>(x, out); });
  return out;
}

void rotary_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin) {
  check_rows(x, 3, "x");
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == x.size(0),
              "positions must be a contiguous int64 tensor with one position per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == x.size(2) &&
                  cos.stride(1) == 1 && sin.strides() == cos.strides(),
              "cos and sin must be float32 [max_positions, head_dim] tables");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position out of range of the tables");
  dispatch_float(x, "rotary_", [&](auto tag) {
    rotary_typed<decltype(tag)>(x, positions, cos, sin);
  });
}

// The checks write_kv_ and write_kv_quantized_ share.
void check_kv_write(const at::Tensor& kv_layer, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slots) {
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.stride(4) == 1,
              "kv_layer must be [blocks, 2, block_size, kv_heads, head_dim], last dim contiguous");
  check_rows(key, 3, "key");
  check_rows(value, 3, "value");
  TORCH_CHECK(key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type() &&
                  key.size(1) == kv_layer.size(3) && key.size(2) == kv_layer.size(4),
              "key and value must be [tokens, kv_heads, head_dim] of the cache's shape");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == key.size(0),
              "slots must be a contiguous int64 tensor with one slot per token");
}

void write_kv_(at::Tensor kv_layer, const at::Tensor& key, const at::Tensor& value,
               const at::Tensor& slots) {
  check_kv_write(kv_layer, key, value, slots);
  dispatch_float(kv_layer, "write_kv_", [&](auto cache_tag) {
    dispatch_float(key, "write_kv_", [&](auto tag) {
      write_kv_typed<decltype(cache_tag), decltype(tag)>(kv_layer, key, value, slots);
    });
  });
}

void write_kv_quantized_(at::Tensor kv_layer, at::Tensor kv_scales, const at::Tensor& key,
                         const at::Tensor& value, const at::Tensor& slots) {
  check_kv_write(kv_layer, key, value, slots);
  TORCH_CHECK(kv_scales.scalar_type() == at::kFloat && kv_scales.dim() == 4 &&
                  kv_scales.sizes() == kv_layer.sizes().slice(0, 4),
              "kv_scales must be float32 [blocks, 2, block_size, kv_heads]");
  const auto body = [&](auto code_tag) {
    dispatch_float(key, "write_kv_quantized_", [&](auto tag) {
      write_kv_quantized_typed<decltype(code_tag), decltype(tag)>(kv_layer, kv_scales, key,
                                                                  value, slots);
    });
  };
  switch (kv_layer.scalar_type()) {
    case at::kChar: return body(int8_t{});
    case at::kFloat8_e4m3fn: return body(c10::Float8_e4m3fn{});
    case at::kFloat8_e5m2: return body(c10::Float8_e5m2{});
    default: TORCH_CHECK(false, "write_kv_quantized_ writes int8 and float8 (e4m3fn, e5m2) only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpool_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv_(Tensor(a!) kv_layer, Tensor key, Tensor value, Tensor slots) -> ()");
  m.def(
      "write_kv_quantized_(Tensor(a!) kv_layer, Tensor(b!) kv_scales, Tensor key, Tensor value, "
      "Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvpool_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
  m.impl("write_kv_", &write_kv_);
  m.impl("write_kv_quantized_", &write_kv_quantized_);
}
