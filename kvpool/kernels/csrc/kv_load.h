// Loading K/V elements of every cache dtype as float32, for the paged decode kernel.
//
// Float caches (float32, bfloat16, float16) widen to their values. Quantized caches (int8,
// float8 e4m3fn, float8 e5m2: `kvpool/memory/kv_quant.py`) widen to their codes, in a unit of
// `kCodeUnit<T>` (the code is `widened * kCodeUnit<T>`): the caller multiplies by
// `scale * kCodeUnit<T>` once per (token, KV head) row, never per element.
//
// The float8 codes widen through float16, which the hardware converts (F16C / AVX-512):
// - e5m2 has float16's exponent and the top 2 of its mantissa bits, so `byte << 8` is the
//   float16 of the same value (infinities and NaN included);
// - e4m3fn has a 4-bit exponent (bias 7) and 3 mantissa bits: placed in a float16 as
//   `sign << 8 | (exponent, mantissa) << 7`, the exponent is read with bias 15, so the float16
//   is exactly value / 256, normals and subnormals alike (e4m3fn's NaN, 0x7f, is never stored:
//   the quantizer clamps to ±448 first). Hence kCodeUnit = 256.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kv_load {

// Whether a cache of element type T holds codes that need scales.
template <typename T>
constexpr bool kIsCode = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn> ||
                         std::is_same_v<T, c10::Float8_e5m2>;

// The value of one widened unit (see the header comment).
template <typename T>
constexpr float kCodeUnit = std::is_same_v<T, c10::Float8_e4m3fn> ? 256.0f : 1.0f;

inline uint8_t byte_at(const void* row, int64_t i) {
  return static_cast<const uint8_t*>(row)[i];
}
inline float half_bits_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Element i of a row, widened to float32 (a code, for the quantized types). bfloat16 is the top
// half of a float32, so widening is a shift, which vectorises; float16 goes through the
// hardware conversion (F16C).
inline float widen(const float* row, int64_t i) { return row[i]; }
inline float widen(const c10::BFloat16* row, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(row)[i]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
inline float widen(const c10::Half* row, int64_t i) { return static_cast<float>(row[i]); }
inline float widen(const int8_t* row, int64_t i) { return static_cast<float>(row[i]); }
inline float widen(const c10::Float8_e5m2* row, int64_t i) {
  return half_bits_to_float(static_cast<uint16_t>(byte_at(row, i) << 8));
}
inline float widen(const c10::Float8_e4m3fn* row, int64_t i) {  // value / 256
  const uint16_t b = byte_at(row, i);
  return half_bits_to_float(static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7f) << 7)));
}

#if defined(__AVX512F__)
// Elements [0, 16) of `src`, widened as `widen` does.
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 load16(const c10::BFloat16* src) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
inline __m128i load_bytes16(const void* src) {
  return _mm_loadu_si128(static_cast<const __m128i*>(src));
}
inline __m512 load16(const int8_t* src) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(src)));
}
inline __m512 load16(const c10::Float8_e5m2* src) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(load_bytes16(src)), 8));
}
inline __m512 load16(const c10::Float8_e4m3fn* src) {
  const __m256i bytes = _mm256_cvtepu8_epi16(load_bytes16(src));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7f)), 7);
  return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}
#endif

// dst[0..n) = widen(src[0..n)), 16 lanes at a time where AVX-512 is there (the compiler does
// not vectorise the scalar `widen` of the narrow types).
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#endif
  for (; i < n; ++i) dst[i] = widen(src, i);
}

// One row as float32: the cache's own memory for a float32 cache, else widened into `scratch`.
inline const float* as_float(const float* row, float*, int64_t) { return row; }
template <typename T>
inline const float* as_float(const T* row, float* scratch, int64_t n) {
  widen_row(row, scratch, n);
  return scratch;
}

#if defined(__AVX512F__)
// A K or V row of kLanes * 16 elements, widened to float32 in registers once, then used by
// every query head of its group (no reload, no re-widening per head).
template <int64_t kLanes>
struct WideRow {
  __m512 lanes[kLanes];
};

template <int64_t kLanes, typename T>
inline void load_wide(WideRow<kLanes>& row, const T* src) {
  for (int64_t l = 0; l < kLanes; ++l) row.lanes[l] = load16(src + 16 * l);
}
#endif

}  // namespace kv_load
