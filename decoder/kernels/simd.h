// Vector helpers of the CPU kernels (decoder/cpu_kernels.py), shared by their two translation units: linear.cpp
// (the matmuls over every weight format) and cpu_kernels.cpp (the other kernels and the Python bindings), built in
// parallel. A 16-float vector is one zmm on AVX-512 hosts or two ymm on AVX2 hosts (GCC vector extensions).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v16c __attribute__((vector_size(16)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

// Calls fn(std::integral_constant<int, N>) with N = n, for 1 <= n <= MAX <= 8: a run-time count of rows as the
// compile-time one a kernel's register arrays are sized by.
template <int MAX, typename Fn>
inline void with_count(int64_t n, Fn&& fn) {
  static_assert(MAX >= 1 && MAX <= 8);
  switch (n) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (MAX >= 2) fn(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (MAX >= 3) fn(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (MAX >= 4) fn(std::integral_constant<int, 4>{}); break;
    case 5: if constexpr (MAX >= 5) fn(std::integral_constant<int, 5>{}); break;
    case 6: if constexpr (MAX >= 6) fn(std::integral_constant<int, 6>{}); break;
    case 7: if constexpr (MAX >= 7) fn(std::integral_constant<int, 7>{}); break;
    case 8: if constexpr (MAX >= 8) fn(std::integral_constant<int, 8>{}); break;
  }
}

inline v16f load(const float* p) { v16f v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
inline v16f splat(float f) { return v16f{} + f; }
inline v16f widen_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
  return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  v16h h; std::memcpy(&h, p, sizeof h);
  return (v16f)(__builtin_convertvector(h, v16u) << 16);
#endif
}
inline float hsum(v16f v) {
  v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
#if defined(__AVX2__)
inline float hsum8(__m256 v) {  // the sum of one ymm register's 8 floats
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#endif
inline float half_at(const uint8_t* p) {
  uint16_t bits; std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}
inline v16f ints_to_float(v16i i) { return __builtin_convertvector(i, v16f); }
// 16 bytes, unsigned or signed, widened to 16 int32 lanes (GCC's generic convertvector would insert them one by one).
template <bool Signed>
inline v16i bytes_to_int(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (v16i)(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i high_half = _mm_srli_si128(b, 8);
  const __m256i lo = Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  const __m256i hi = Signed ? _mm256_cvtepi8_epi32(high_half) : _mm256_cvtepu8_epi32(high_half);
  v16i out;
  std::memcpy(&out, &lo, 32); std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
#else
  if constexpr (Signed) {
    v16c bytes; std::memcpy(&bytes, p, sizeof bytes);
    return __builtin_convertvector(bytes, v16i);
  } else {
    v16b bytes; std::memcpy(&bytes, p, sizeof bytes);
    return __builtin_convertvector(bytes, v16i);
  }
#endif
}

// e^x for a vector (Cephes' expf polynomial, about 1 ulp); e^x = 0 below -87.3 (a -inf mask entry included).
inline v16f vexp(v16f x) {
  const v16i underflow = x < -87.33654f;
  x = x > 88.37626f ? splat(88.37626f) : x;
  x = x < -87.33654f ? splat(-87.33654f) : x;
  v16f t = x * 1.44269504088896341f;
  v16f k = ints_to_float(__builtin_convertvector(t, v16i));
  k = k > t ? k - 1.0f : k;  // floor
  v16f r = x - k * 0.693359375f + k * 2.12194440e-4f;
  v16f y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  v16i scale = (__builtin_convertvector(k, v16i) + 127) << 23;
  y = y * (v16f)scale;
  return underflow ? splat(0.0f) : y;
}

}  // namespace
