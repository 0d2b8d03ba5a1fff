// Eight-lane helpers the package's kernels share (AVX2): float32, bfloat16 or int8 loads widened to
// float32 (a bfloat16 is a float32's upper half), scalar widening, and one fixed horizontal sum.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace entmtp_simd {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float scalar(float v) { return v; }
inline float scalar(int8_t v) { return static_cast<float>(v); }
inline float scalar(c10::BFloat16 v) { return static_cast<float>(v); }

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace entmtp_simd
