// CPU kernels for the lean forward (decoder/model.py), built for the host they run on (decoder/cpu_kernels.py).
//
// A one-token forward of a small model on a CPU is a few weight passes and many tiny operators; PyTorch's eager
// operators cost microseconds each and oneDNN's one-row matmuls stream weights at about half the bandwidth.
// These kernels do each step of a layer in one call, on torch's own thread pool (at::parallel_for):
//   linear       x @ W^T + b for W in fp32, bf16 or a GGUF block format as the file ships it (Q4_0, Q4_1, Q5_0,
//                Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), each block decoded in registers as it streams: no dequantized copy;
//   rope_store   q/k (optionally RMS-normed per head) rotated, k and v written to the layer's cache slots;
//   attention    softmax(q k^T * scale + mask) v over the cache for few query rows, grouped KV heads, keys split
//                in chunks across threads and merged (flash-decoding);
//   rms_norm     with the residual add fused; gated_activation (SiLU or GELU-tanh gate times up); dequantize and
//                dequantize_rows (an embedding lookup in a block format).
// Arithmetic is fp32; bf16 tensors are widened on load and rounded (nearest-even) on store, where the eager
// forward rounds its output. Portable across AVX-512 and AVX2 hosts through GCC vector extensions (a 16-float
// vector is one zmm or two ymm); avx512_bf16 hosts take vdpbf16ps for bf16 weights.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

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

// Rows of activations dotted with a weight row per pass over it, their accumulators in registers: 8 x 2 fit
// AVX-512's 32 registers. Up to direct_rows(format) rows (decoding, token trees) take passes of ROW_TILE rows
// over each weight row, a block format's blocks decoded in registers once per pass; more (prefill chunks) read
// TILE_W weight rows as fp32 (decoded once into a buffer) and run register tiles over them. The limits are
// measured (matmul passes over smollm2-135m's layers on a 2-core EPYC, bench/kernel_variants.py): fp32 rows
// stream best in tiles from 5 rows on, bf16 from 9, decoded blocks from 17 (from 32 rows, decoding once beats a
// pass per 8). With AVX2's 16 registers fp32 takes passes of 4 rows (one accumulator of two registers per row):
// whole smollm2 forwards of 3 and 4 rows ran 10-25% faster than in passes of 2 (bench/kernel_variants.py forward).
#ifdef __AVX512F__
constexpr int ROW_TILE = 8;
constexpr int64_t DIRECT_ROWS_F32 = 4, DIRECT_ROWS_BF16 = 8, DIRECT_ROWS_BLOCKS = 16;
#else
#ifndef AVX2_ROW_TILE
#define AVX2_ROW_TILE 4
#endif
#ifndef AVX2_DIRECT_ROWS_F32
#define AVX2_DIRECT_ROWS_F32 4
#endif
constexpr int ROW_TILE = AVX2_ROW_TILE;
constexpr int64_t DIRECT_ROWS_F32 = AVX2_DIRECT_ROWS_F32, DIRECT_ROWS_BF16 = 2, DIRECT_ROWS_BLOCKS = 2;
#endif
// From this many activation rows a matmul of fp32, bf16 or (not K-quant) block weights runs as torch's own GEMM
// (MKL or oneDNN) over the weight in fp32 panels (linear_gemm). With AVX2's 16 vector registers the register tiles
// stay small and compute-bound: on a 2-core AVX2 EPYC the GEMM passes smollm2's layers from 5 rows on, and runs
// prefill chunks several times faster (bench/kernel_variants.py gemm). With AVX-512 the tiles were measured best
// for 8 to 64 rows; prefill chunks take the GEMM.
#ifndef TORCH_GEMM_ROWS
#ifdef __AVX512F__
#define TORCH_GEMM_ROWS 65
#else
#define TORCH_GEMM_ROWS 5
#endif
#endif
constexpr int64_t GEMM_PANEL_FLOATS = 1 << 22;  // a decoded panel of weight rows: 16 MB, whatever the matrix

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

// ---------------------------------------------------------------------------------------------------------------
// Weight formats, named as GGML names its types (Python passes the name; GGML's numeric ids stay in gguf-py's
// GGMLQuantizationType), and for each block format its decoding into floats, written after ggml's
// dequantize_row_* (ggml-quants.c) so that a block means exactly what llama.cpp reads from the same file.

enum Format : int64_t { F32, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, FORMAT_COUNT };
const char* const FORMAT_NAMES[FORMAT_COUNT] = {"F32", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K",
                                                "Q5_K", "Q6_K"};

int64_t format_named(const std::string& name) {
  for (int64_t f = 0; f < FORMAT_COUNT; f++)
    if (name == FORMAT_NAMES[f]) return f;
  TORCH_CHECK(false, "unsupported weight format ", name);
}

const v16i LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

template <int F> struct Block;

template <> struct Block<BF16> {
  static constexpr int elems = 32, bytes = 64;
  template <typename Emit>
  static void each(const uint8_t* b, Emit&& emit) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(b);
    emit(0, widen_bf16(h));
    emit(16, widen_bf16(h + 16));
  }
};

template <> struct Block<Q4_0> {  // d (fp16), 16 bytes: element j in the low nibble of byte j, j + 16 in the high
  static constexpr int elems = 32, bytes = 18;
  template <typename Emit>
  static void each(const uint8_t* b, Emit&& emit) {
    const float d = half_at(b);
    const v16i q = bytes_to_int<false>(b + 2);
    emit(0, ints_to_float((q & 15) - 8) * d);
    emit(16, ints_to_float((q >> 4) - 8) * d);
  }
};

template <> struct Block<Q4_1> {  // d, m (fp16), 16 bytes of nibbles: y = d q + m
  static constexpr int elems = 32, bytes = 20;
  template <typename Emit>
  static void each(const uint8_t* b, Emit&& emit) {
    const float d = half_at(b), m = half_at(b + 2);
    const v16i q = bytes_to_int<false>(b + 4);
    emit(0, ints_to_float(q & 15) * d + m);
    emit(16, ints_to_float(q >> 4) * d + m);
  }
};

inline void high_bits(uint32_t qh, v16i& low_half, v16i& high_half) {  // bit j of qh is the fifth bit of element j
  const v16i bits = v16i{} + static_cast<int32_t>(qh);
  low_half = ((bits >> LANE) << 4) & 0x10;
  high_half = (bits >> (LANE + 12)) & 0x10;
}

template <> struct Block<Q5_0> {  // d, qh (32 bits), 16 bytes of nibbles: y = d (q - 16)
  static constexpr int elems = 32, bytes = 22;
  template <typename Emit>
  static void each(const uint8_t* b, Emit&& emit) {
    const float d = half_at(b);
    uint32_t qh; std::memcpy(&qh, b + 2, 4);
    v16i h0, h1; high_bits(qh, h0, h1);
    const v16i q = bytes_to_int<false>(b + 6);
    emit(0, ints_to_float(((q & 15) | h0) - 16) * d);
    emit(16, ints_to_float(((q >> 4) | h1) - 16) * d);
  }
};

template <> struct Block<Q5_1> {  // d, m, qh, 16 bytes of nibbles: y = d q + m
  static constexpr int elems = 32, bytes = 24;
  template <typename Emit>
  static void each(const uint8_t* b, Emit&& emit) {
    const float d = half_at(b), m = half_at(b + 2);
    uint32_t qh; std::memcpy(&qh, b + 4, 4);
    v16i h0, h1; high_bits(qh, h0, h1);
    const v16i q = bytes_to_int<false>(b + 8);
    emit(0, ints_to_float((q & 15) | h0) * d + m);
    emit(16, ints_to_float((q >> 4) | h1) * d + m);
  }
};

template <> struct Block<Q8_0> {  // d, 32 int8: y = d q
  static constexpr int elems = 32, bytes = 34;
  template <typename Emit>
  static void each(const uint8_t* b, Emit&& emit) {
    const float d = half_at(b);
    emit(0, ints_to_float(bytes_to_int<true>(b + 2)) * d);
    emit(16, ints_to_float(bytes_to_int<true>(b + 18)) * d);
  }
};

// K-quants: 256-element super-blocks of 8 sub-blocks with 6-bit scales and mins packed in 12 bytes; unpacked
// all at once with ggml's masks (ggml-quants.c, ggml_vec_dot_q4_K_q8_K): bytes 0-7 the scales, 8-15 the mins.
inline void scales_mins_k4(const uint8_t* packed, uint8_t out[16]) {
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  const uint32_t mins_low = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  u[2] = mins_low;
  u[0] &= low6;
  std::memcpy(out, u, 16);
}

template <> struct Block<Q4_K> {  // d, dmin, 12 bytes of scales, 128 bytes: 32 bytes per 64 elements
  static constexpr int elems = 256, bytes = 144;
  template <typename Emit>
  static void each(const uint8_t* b, Emit&& emit) {
    const float d = half_at(b), dmin = half_at(b + 2);
    uint8_t sm[16];
    scales_mins_k4(b + 4, sm);
    const uint8_t* qs = b + 16;
#pragma GCC unroll 4
    for (int c = 0, base = 0; c < 4; c++, qs += 32, base += 64) {
      const float d0 = d * sm[2 * c], n0 = dmin * sm[8 + 2 * c], d1 = d * sm[2 * c + 1], n1 = dmin * sm[9 + 2 * c];
#pragma GCC unroll 2
      for (int h = 0; h < 32; h += 16) {
        const v16i q = bytes_to_int<false>(qs + h);
        emit(base + h, ints_to_float(q & 15) * d0 - n0);
        emit(base + 32 + h, ints_to_float(q >> 4) * d1 - n1);
      }
    }
  }
};

template <> struct Block<Q5_K> {  // d, dmin, scales, 32 bytes of fifth bits, 128 bytes of nibbles
  static constexpr int elems = 256, bytes = 176;
  template <typename Emit>
  static void each(const uint8_t* b, Emit&& emit) {
    const float d = half_at(b), dmin = half_at(b + 2);
    uint8_t sm[16];
    scales_mins_k4(b + 4, sm);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
#pragma GCC unroll 4
    for (int c = 0, base = 0; c < 4; c++, qs += 32, base += 64) {
      const float d0 = d * sm[2 * c], n0 = dmin * sm[8 + 2 * c], d1 = d * sm[2 * c + 1], n1 = dmin * sm[9 + 2 * c];
#pragma GCC unroll 2
      for (int h = 0; h < 32; h += 16) {
        const v16i q = bytes_to_int<false>(qs + h);
        const v16i high = bytes_to_int<false>(qh + h);
        const v16i h0 = ((high >> (2 * c)) & 1) << 4, h1 = ((high >> (2 * c + 1)) & 1) << 4;
        emit(base + h, ints_to_float((q & 15) | h0) * d0 - n0);
        emit(base + 32 + h, ints_to_float((q >> 4) | h1) * d1 - n1);
      }
    }
  }
};

template <> struct Block<Q6_K> {  // 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d: y = d s (q - 32)
  static constexpr int elems = 256, bytes = 210;
  template <typename Emit>
  static void each(const uint8_t* b, Emit&& emit) {
    const float d = half_at(b + 208);
    float scale[16], offset[16];  // y = scale q + offset, offset = -32 scale
    for (int i = 0; i < 16; i++) {
      scale[i] = d * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[i]);
      offset[i] = -32.0f * scale[i];
    }
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
#pragma GCC unroll 2
    for (int half = 0, base = 0, is = 0; half < 2; half++, ql += 64, qh += 32, base += 128, is += 8) {
#pragma GCC unroll 2
      for (int l = 0; l < 32; l += 16, is++) {
        const v16i a = bytes_to_int<false>(ql + l), c = bytes_to_int<false>(ql + l + 32);
        const v16i h = bytes_to_int<false>(qh + l);
        emit(base + l, ints_to_float((a & 15) | ((h << 4) & 0x30)) * scale[is] + offset[is]);
        emit(base + l + 32, ints_to_float((c & 15) | ((h << 2) & 0x30)) * scale[is + 2] + offset[is + 2]);
        emit(base + l + 64, ints_to_float((a >> 4) | (h & 0x30)) * scale[is + 4] + offset[is + 4]);
        emit(base + l + 96, ints_to_float((c >> 4) | ((h >> 2) & 0x30)) * scale[is + 6] + offset[is + 6]);
      }
      is -= 2;
    }
  }
};

template <> struct Block<F32> {  // fp32 rows need no blocks: one 16-float vector is the unit
  static constexpr int elems = 16, bytes = 64;
  template <typename Emit>
  static void each(const uint8_t* b, Emit&& emit) {
    for (int e = 0; e < elems; e += 16) emit(e, load(reinterpret_cast<const float*>(b) + e));
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Dot products of one weight row with up to ROW_TILE activation rows (fp32, leading dimension ldx).

template <int NR>
inline void dot_f32(const float* w, const float* x, int64_t ldx, int64_t k, float* out) {
#ifndef __AVX512F__
  if constexpr (NR > 2) {  // AVX2's 16 registers: one 16-float accumulator (two registers) per activation row
    v16f acc[NR] = {};
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
      const v16f w0 = load(w + c);
      for (int r = 0; r < NR; r++) acc[r] += w0 * load(x + r * ldx + c);
    }
    for (int r = 0; r < NR; r++) {
      float s = hsum(acc[r]);
      for (int64_t t = c; t < k; t++) s += w[t] * x[r * ldx + t];
      out[r] = s;
    }
    return;
  }
#endif
  v16f acc[NR][2] = {};
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    const v16f w0 = load(w + c), w1 = load(w + c + 16);
    for (int r = 0; r < NR; r++) {
      acc[r][0] += w0 * load(x + r * ldx + c);
      acc[r][1] += w1 * load(x + r * ldx + c + 16);
    }
  }
  for (int r = 0; r < NR; r++) {
    float s = hsum(acc[r][0] + acc[r][1]);
    for (int64_t t = c; t < k; t++) s += w[t] * x[r * ldx + t];
    out[r] = s;
  }
}

// A WT x XT tile of outputs: WT weight rows (fp32, leading dimension k) against XT activation rows, with every
// loaded vector used WT or XT times (for more activation rows than ROW_TILE: tree forwards, prefill chunks).
template <int WT, int XT>
inline void dot_tile(const float* w, const float* x, int64_t k, float out[WT][XT]) {
  v16f acc[WT][XT] = {};
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) {
    v16f wv[WT], xv[XT];
    for (int a = 0; a < WT; a++) wv[a] = load(w + a * k + c);
    for (int b = 0; b < XT; b++) xv[b] = load(x + b * k + c);
    for (int a = 0; a < WT; a++)
      for (int b = 0; b < XT; b++) acc[a][b] += wv[a] * xv[b];
  }
  for (int a = 0; a < WT; a++)
    for (int b = 0; b < XT; b++) {
      float s = hsum(acc[a][b]);
      for (int64_t t = c; t < k; t++) s += w[a * k + t] * x[b * k + t];
      out[a][b] = s;
    }
}

// Block formats decode slowly enough that the hardware prefetcher alone leaves DRAM bandwidth unused (Q6_K streamed
// at 14 GB/s without this); the decode loop asks for the bytes this far ahead.
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

// Each weight block is decoded in registers (Block<F>::each hands over 16 values at a time) and dotted at once,
// into four accumulators per row (independent FMA chains: the 16-value pieces of 64 elements go to different
// ones, so two 32-element blocks are taken per step). The blocks' loops are unrolled so that every offset, and
// with it the accumulator, is known at compile time (a run-time index would keep the accumulators in memory).
template <int F, int NR>
inline void dot_blocks(const uint8_t* row, const float* x, int64_t ldx, int64_t k, float* out) {
  constexpr int E = Block<F>::elems, B = Block<F>::bytes, STEP = E >= 64 ? 1 : 64 / E;
  constexpr int ACC = NR <= 4 ? 4 : 2;  // accumulators per row, as many as the registers hold
  v16f acc[NR][ACC] = {};
  const int64_t blocks = k / E;
  auto one_block = [&](int64_t b, auto shift) {
    const float* xb = x + b * E;
    const uint8_t* block = row + b * B;
    for (int line = 0; line < B; line += 64) __builtin_prefetch(block + PREFETCH_BYTES + line);
    Block<F>::each(block, [&](int offset, v16f w) {
      const int slot = ((offset + decltype(shift)::value) >> 4) & (ACC - 1);
      for (int r = 0; r < NR; r++) acc[r][slot] += w * load(xb + r * ldx + offset);
    });
  };
  int64_t b = 0;
  for (; b + STEP <= blocks; b += STEP) {
    one_block(b, std::integral_constant<int, 0>{});
    if constexpr (STEP > 1) one_block(b + 1, std::integral_constant<int, E>{});
  }
  for (; b < blocks; b++) one_block(b, std::integral_constant<int, 0>{});
  for (int r = 0; r < NR; r++) {
    v16f total = acc[r][0];
    for (int a = 1; a < ACC; a++) total += acc[r][a];
    out[r] = hsum(total);
  }
}

#ifdef __AVX512BF16__
template <int NR>
inline void dot_bf16(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t k, float* out) {
  __m512 acc[NR];
  for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + c);
    for (int r = 0; r < NR; r++)
      acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_loadu_si512(x + r * ldx + c));
  }
  for (int r = 0; r < NR; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

template <int F>
void decode_row(const uint8_t* row, int64_t k, float* y) {
  for (int64_t b = 0; b < k / Block<F>::elems; b++, y += Block<F>::elems)
    Block<F>::each(row + b * Block<F>::bytes, [&](int offset, v16f w) { store(y + offset, w); });
}

// Calls fn(std::integral_constant<int, NR>) for a tile of nr activation rows (1 <= nr <= ROW_TILE).
template <typename Fn>
inline void with_tile(int nr, Fn&& fn) {
  switch (nr) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
#ifdef __AVX512F__
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
#endif
  }
}

inline void store_row_outputs(const float* part, int nr, float bias, int64_t i, int64_t r, int64_t rows, float* out_f,
                              c10::BFloat16* out_h) {
  for (int j = 0; j < nr; j++) {
    const float v = part[j] + bias;
    if (out_f) out_f[(i + j) * rows + r] = v; else out_h[(i + j) * rows + r] = c10::BFloat16(v);
  }
}

// Weight rows x activation rows per register tile, for more than ROW_TILE activation rows.
#ifndef TILE_W
#ifdef __AVX512F__  // measured on a 2-core EPYC: 8 x 2 beat 4 x 4, 6 x 4, 2 x 8 and 12 x 2 for 8 to 64 rows
#define TILE_W 8
#define TILE_X 2
#else
#define TILE_W 2
#define TILE_X 2
#endif
#endif

// Calls fn(std::integral_constant<int, XT>) for an edge tile of xt < TILE_X activation rows.
template <typename Fn>
inline void with_edge(int xt, Fn&& fn) {
  switch (xt) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
#if TILE_X > 2
    case 2: fn(std::integral_constant<int, 2>{}); break;
#endif
#if TILE_X > 3
    case 3: fn(std::integral_constant<int, 3>{}); break;
#endif
#if TILE_X > 4
    case 4: fn(std::integral_constant<int, 4>{}); break;
#endif
#if TILE_X > 5
    case 5: fn(std::integral_constant<int, 5>{}); break;
#endif
  }
}

// Runs tile(w rows r0.., x rows i.., part) over every (weight rows, activation rows) tile of the output, weight
// row groups split across threads; `prepare(r0, wt)` readies a group's rows (decodes them) before its tiles.
template <typename Prepare, typename Tile>
void tiled(int64_t n, int64_t rows, const float* bias, float* out_f, c10::BFloat16* out_h, Prepare&& prepare,
           Tile&& tile) {
  at::parallel_for(0, (rows + TILE_W - 1) / TILE_W, 4, [&](int64_t begin, int64_t end) {
    auto state = prepare.make();
    float part[TILE_W][TILE_X];
    for (int64_t group = begin; group < end; group++) {
      const int64_t r0 = group * TILE_W;
      const int wt = static_cast<int>(std::min<int64_t>(TILE_W, rows - r0));
      prepare(state, r0, wt);
      for (int64_t i = 0; i < n; i += TILE_X) {
        const int xt = static_cast<int>(std::min<int64_t>(TILE_X, n - i));
        tile(state, r0, wt, i, xt, part);
        for (int a = 0; a < wt; a++) {
          const float b = bias ? bias[r0 + a] : 0.0f;
          for (int j = 0; j < xt; j++) {
            const float v = part[a][j] + b;
            if (out_f) out_f[(i + j) * rows + r0 + a] = v; else out_h[(i + j) * rows + r0 + a] = c10::BFloat16(v);
          }
        }
      }
    }
  });
}

// out[i, r] = x[i] . W[r] + bias[r], weight rows split across threads: a few activation rows in passes of ROW_TILE
// over each weight row (its blocks decoded in registers), more with register tiles (above).
template <int F>
void linear_rows(const float* x, int64_t n, int64_t k, const uint8_t* weight, int64_t row_bytes, const float* bias,
                 float* out_f, c10::BFloat16* out_h, int64_t rows) {
  if (n <= (F == F32 ? DIRECT_ROWS_F32 : DIRECT_ROWS_BLOCKS)) {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      float part[ROW_TILE];
      for (int64_t r = begin; r < end; r++) {
        const uint8_t* row = weight + r * row_bytes;
        for (int64_t i = 0; i < n; i += ROW_TILE) {
          const int nr = static_cast<int>(std::min<int64_t>(ROW_TILE, n - i));
          with_tile(nr, [&](auto tile) {
            constexpr int NR = decltype(tile)::value;
            if constexpr (F == F32) dot_f32<NR>(reinterpret_cast<const float*>(row), x + i * k, k, k, part);
            else dot_blocks<F, NR>(row, x + i * k, k, k, part);
          });
          store_row_outputs(part, nr, bias ? bias[r] : 0.0f, i, r, rows, out_f, out_h);
        }
      }
    });
    return;
  }
  struct Decoder {  // the fp32 rows of a group: the weight itself, or decoded into a per-thread buffer
    int64_t k, row_bytes;
    const uint8_t* weight;
    std::vector<float> make() const { return std::vector<float>(F == F32 ? 0 : TILE_W * k); }
    void operator()(std::vector<float>& buffer, int64_t r0, int wt) const {
      if constexpr (F != F32)
        for (int a = 0; a < wt; a++) decode_row<F>(weight + (r0 + a) * row_bytes, k, buffer.data() + a * k);
    }
  } decoder{k, row_bytes, weight};
  tiled(n, rows, bias, out_f, out_h, decoder,
        [&](std::vector<float>& buffer, int64_t r0, int wt, int64_t i, int xt, float (*part)[TILE_X]) {
          const float* w = F == F32 ? reinterpret_cast<const float*>(weight + r0 * row_bytes) : buffer.data();
          if (wt == TILE_W && xt == TILE_X) {
            dot_tile<TILE_W, TILE_X>(w, x + i * k, k, part);
            return;
          }
          if (wt == TILE_W) {
            with_edge(xt, [&](auto edge) {
              constexpr int XT = decltype(edge)::value;
              float edge_part[TILE_W][XT];
              dot_tile<TILE_W, XT>(w, x + i * k, k, edge_part);
              for (int a = 0; a < TILE_W; a++) std::copy(edge_part[a], edge_part[a] + XT, part[a]);
            });
            return;
          }
          for (int a = 0; a < wt; a++)
            for (int b = 0; b < xt; b++) {
              float one[1][1];
              dot_tile<1, 1>(w + a * k, x + (i + b) * k, k, one);
              part[a][b] = one[0][0];
            }
        });
}

#ifdef __AVX512BF16__
template <int WT, int XT>
inline void dot_tile_bf16(const uint16_t* w, const uint16_t* x, int64_t k, float out[][TILE_X]) {
  __m512 acc[WT][XT];
  for (int a = 0; a < WT; a++)
    for (int b = 0; b < XT; b++) acc[a][b] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {
    __m512bh wv[WT], xv[XT];
    for (int a = 0; a < WT; a++) wv[a] = (__m512bh)_mm512_loadu_si512(w + a * k + c);
    for (int b = 0; b < XT; b++) xv[b] = (__m512bh)_mm512_loadu_si512(x + b * k + c);
    for (int a = 0; a < WT; a++)
      for (int b = 0; b < XT; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[a], xv[b]);
  }
  for (int a = 0; a < WT; a++)
    for (int b = 0; b < XT; b++) out[a][b] = _mm512_reduce_add_ps(acc[a][b]);
}

// bf16 weights and activations on a CPU with avx512_bf16: vdpbf16ps (pairs of bf16 products into fp32 lanes).
void linear_bf16_native(const uint16_t* x, int64_t n, int64_t k, const uint16_t* weight, const float* bias,
                        float* out_f, c10::BFloat16* out_h, int64_t rows) {
  if (n <= DIRECT_ROWS_BF16) {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      float part[ROW_TILE];
      for (int64_t r = begin; r < end; r++) {
        for (int64_t i = 0; i < n; i += ROW_TILE) {
          const int nr = static_cast<int>(std::min<int64_t>(ROW_TILE, n - i));
          with_tile(nr, [&](auto tile) { dot_bf16<decltype(tile)::value>(weight + r * k, x + i * k, k, k, part); });
          store_row_outputs(part, nr, bias ? bias[r] : 0.0f, i, r, rows, out_f, out_h);
        }
      }
    });
    return;
  }
  struct NoPreparation {
    int make() const { return 0; }
    void operator()(int, int64_t, int) const {}
  };
  tiled(n, rows, bias, out_f, out_h, NoPreparation{},
        [&](int, int64_t r0, int wt, int64_t i, int xt, float (*part)[TILE_X]) {
          const uint16_t* w = weight + r0 * k;
          if (wt == TILE_W && xt == TILE_X) {
            dot_tile_bf16<TILE_W, TILE_X>(w, x + i * k, k, part);
          } else if (wt == TILE_W) {
            with_edge(xt, [&](auto edge) { dot_tile_bf16<TILE_W, decltype(edge)::value>(w, x + i * k, k, part); });
          } else {
            for (int a = 0; a < wt; a++)
              with_tile(1, [&](auto) {
                for (int b = 0; b < xt; b++) {
                  float one[TILE_X];
                  dot_bf16<1>(w + a * k, x + (i + b) * k, k, k, one);
                  part[a][b] = one[0];
                }
              });
          }
        });
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// Q4_K weights against 8-bit activations (llama.cpp's Q4_K x Q8_K). A Q4_K block's values are 6-bit integer
// sub-block scales times 4-bit integers: with the activations rounded to 8 bits in blocks of 256 (one scale each,
// llama.cpp's Q8_K), a whole block's dot product is integer arithmetic (pairwise byte products, then the integer
// scales) and one float scaling, about a third of the vector work of decoding to fp32. Every Q4_K matmul takes
// this path, for any number of rows, so a row's result does not depend on how many rows a forward scores.

constexpr int64_t Q8_BLOCK = 256;

// 16 floats rounded to the nearest integers (ties to even), as int32.
inline v16i round_to_int(v16f v) {
#if defined(__AVX512F__)
  return (v16i)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX2__)
  v16i out;
  __m256 halves[2];
  std::memcpy(halves, &v, sizeof v);
  const __m256i lo = _mm256_cvtps_epi32(halves[0]), hi = _mm256_cvtps_epi32(halves[1]);
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
#else
  v16i out;
  for (int i = 0; i < 16; i++) out[i] = static_cast<int32_t>(std::nearbyint(v[i]));
  return out;
#endif
}

// x rounded to int8 per 256 values (llama.cpp's Q8_K): q = round(x * 127 / max|x|), d = max|x| / 127, and the
// sums of each 16 quantized values (the K-quants' mins and offsets multiply them).
struct Q8Rows {
  int64_t k;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sums;  // per 16 values (at most 16 * 127 in magnitude)

  Q8Rows(const float* x, int64_t n, int64_t k) : k(k), q(n * k), d(n * k / Q8_BLOCK), sums(n * k / 16) {
    for (int64_t block = 0; block < n * k / Q8_BLOCK; block++) {
      const float* v = x + block * Q8_BLOCK;
      v16f top = {};
      for (int64_t i = 0; i < Q8_BLOCK; i += 16) {
        const v16f a = load(v + i);
        const v16f magnitude = a < 0.0f ? -a : a;
        top = magnitude > top ? magnitude : top;
      }
      float largest = 0.0f;
      for (int i = 0; i < 16; i++) largest = std::max(largest, top[i]);
      const float scale = largest > 0.0f ? 127.0f / largest : 0.0f;
      d[block] = largest / 127.0f;
      for (int64_t i = 0; i < Q8_BLOCK; i += 16) {
        const v16i rounded = round_to_int(load(v + i) * scale);  // within [-127, 127]
        int32_t sum = 0;
        for (int j = 0; j < 16; j++) {
          q[block * Q8_BLOCK + i + j] = static_cast<int8_t>(rounded[j]);
          sum += rounded[j];
        }
        sums[(block * Q8_BLOCK + i) / 16] = static_cast<int16_t>(sum);
      }
    }
  }
  const int8_t* row_block(int64_t row, int64_t block) const { return q.data() + row * k + block * Q8_BLOCK; }
  float scale(int64_t row, int64_t block) const { return d[row * (k / Q8_BLOCK) + block]; }
  const int16_t* block_sums(int64_t row, int64_t block) const { return sums.data() + row * (k / 16) + block * 16; }
};

// One activation row's sum over a weight row's blocks. With AVX-512 each block's integer lane sums are scaled into
// fp32 lanes, reduced once per weight row (no horizontal sum per block).
#if defined(__AVX512BW__)
struct Q8Accumulator {
  __m512 products = _mm512_setzero_ps();  // d dx (q . x) per lane
  __m256 offsets = _mm256_setzero_ps();   // the K-quants' mins (Q4_K) or offsets (Q6_K) per lane
  float total() const { return _mm512_reduce_add_ps(_mm512_add_ps(products, _mm512_zextps256_ps512(offsets))); }
};
#else
struct Q8Accumulator {
  float sum = 0.0f;
  float total() const { return sum; }
};
#endif

#if defined(__AVX2__)
inline int32_t hsum_epi32(__m256i v) {
  const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i quarter = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
  return _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 1)));
}
#endif

// One Q4_K block (144 bytes) against rows 0..NR-1 of x's block `block`: adds d dx sum_j s_j (q_j . x_j) - dmin dx
// sum_j m_j sum(x_j) to acc[r].
template <int NR>
inline void dot_q4k_block(const uint8_t* w, const Q8Rows& x, int64_t row0, int64_t block, Q8Accumulator* acc) {
  const float d = half_at(w), dmin = half_at(w + 2);
  uint8_t sm[16];
  scales_mins_k4(w + 4, sm);
  const uint8_t* qs = w + 16;
#if defined(__AVX512BW__)
  // 64 values per register: the low nibbles of 32 bytes (one sub-block) below their high nibbles (the next), the
  // order of the activations
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i values[4], scale[4];
  for (int c = 0; c < 4; c++) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    values[c] = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1), low4);
    scale[c] = _mm512_inserti64x4(_mm512_set1_epi16(sm[2 * c]), _mm256_set1_epi16(sm[2 * c + 1]), 1);
  }
  alignas(32) int16_t mins_per_16[16];  // m_j for both halves of sub-block j, against the sums of 16 activations
  for (int j = 0; j < 16; j++) mins_per_16[j] = sm[8 + j / 2];
  const __m256i mins = _mm256_load_si256(reinterpret_cast<const __m256i*>(mins_per_16));
  for (int r = 0; r < NR; r++) {
    const int8_t* xq = x.row_block(row0 + r, block);
    __m512i sum = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++)
      sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(values[c], _mm512_loadu_si512(xq + 64 * c)),
                                                    scale[c]));
    const __m256i min_terms =
        _mm256_madd_epi16(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.block_sums(row0 + r, block))));
    const float dx = x.scale(row0 + r, block);
    acc[r].products = _mm512_fmadd_ps(_mm512_set1_ps(dx * d), _mm512_cvtepi32_ps(sum), acc[r].products);
    acc[r].offsets = _mm256_fmadd_ps(_mm256_set1_ps(-dx * dmin), _mm256_cvtepi32_ps(min_terms), acc[r].offsets);
  }
#elif defined(__AVX2__)
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i low[4], high[4], scale[8];
  for (int c = 0; c < 4; c++) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    low[c] = _mm256_and_si256(packed, low4);
    high[c] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
  }
  for (int j = 0; j < 8; j++) scale[j] = _mm256_set1_epi16(sm[j]);
  for (int r = 0; r < NR; r++) {
    const int8_t* xq = x.row_block(row0 + r, block);
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {  // bytes: unsigned 4-bit weights times signed 8-bit activations, pairwise in int16
      const __m256i a = _mm256_maddubs_epi16(low[c], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * c)));
      const __m256i b =
          _mm256_maddubs_epi16(high[c], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * c + 32)));
      sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_madd_epi16(a, scale[2 * c]), _mm256_madd_epi16(b, scale[2 * c + 1])));
    }
    const int32_t total = hsum_epi32(sum);
    const int16_t* sums = x.block_sums(row0 + r, block);
    int32_t mins = 0;
    for (int j = 0; j < 8; j++) mins += sm[8 + j] * (sums[2 * j] + sums[2 * j + 1]);
    const float dx = x.scale(row0 + r, block);
    acc[r].sum += dx * (d * static_cast<float>(total) - dmin * static_cast<float>(mins));
  }
#else
  for (int r = 0; r < NR; r++) {
    const int8_t* xq = x.row_block(row0 + r, block);
    const int16_t* sums = x.block_sums(row0 + r, block);
    int32_t total = 0, mins = 0;
    for (int c = 0; c < 4; c++) {
      int32_t a = 0, b = 0;
      for (int l = 0; l < 32; l++) {
        a += (qs[32 * c + l] & 0xF) * xq[64 * c + l];
        b += (qs[32 * c + l] >> 4) * xq[64 * c + 32 + l];
      }
      total += sm[2 * c] * a + sm[2 * c + 1] * b;
    }
    for (int j = 0; j < 8; j++) mins += sm[8 + j] * (sums[2 * j] + sums[2 * j + 1]);
    acc[r].sum += x.scale(row0 + r, block) * (d * static_cast<float>(total) - dmin * static_cast<float>(mins));
  }
#endif
}

// One Q6_K block (210 bytes) against rows 0..NR-1 of x's block `block`: adds d dx sum_j s_j ((q_j - 32) . x_j) to
// acc[r], s_j the int8 scale of the j-th 16 values.
template <int NR>
inline void dot_q6k_block(const uint8_t* w, const Q8Rows& x, int64_t row0, int64_t block, Q8Accumulator* acc) {
  const float d = half_at(w + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
#if defined(__AVX512BW__)
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  // values[2 half + p]: elements 64p..64p+63 of the half, in the order of the activations; its four 16-value
  // groups have the scales sc[4 (2 half + p)] .. sc[4 (2 half + p) + 3], one per 128-bit lane
  const __m512i scales16 = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))));
  __m512i values[4], scale[4];
  for (int half = 0; half < 2; half++) {
    const uint8_t* ql = w + 64 * half;
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * half));
    const __m256i v0 = _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), bits45));
    const __m256i v1 = _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), bits45));
    const __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(h, bits45));
    const __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low4),
                                       _mm256_and_si256(_mm256_srli_epi16(h, 2), bits45));
    values[2 * half] = _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1);
    values[2 * half + 1] = _mm512_inserti64x4(_mm512_castsi256_si512(v2), v3, 1);
  }
  for (int q = 0; q < 4; q++) {  // lane i of scale[q]: sc[4q + i / 8]
    alignas(64) int16_t index[32];
    for (int i = 0; i < 32; i++) index[i] = static_cast<int16_t>(4 * q + i / 8);
    scale[q] = _mm512_permutexvar_epi16(_mm512_load_si512(index), scales16);
  }
  const __m256i offsets16 = _mm512_castsi512_si256(scales16);  // sc_j against the sums of 16 activations
  for (int r = 0; r < NR; r++) {
    const int8_t* xq = x.row_block(row0 + r, block);
    __m512i sum = _mm512_setzero_si512();
    for (int q = 0; q < 4; q++)
      sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(values[q], _mm512_loadu_si512(xq + 64 * q)),
                                                    scale[q]));
    const __m256i offset_terms = _mm256_madd_epi16(
        offsets16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.block_sums(row0 + r, block))));
    const float dx_d = x.scale(row0 + r, block) * d;
    acc[r].products = _mm512_fmadd_ps(_mm512_set1_ps(dx_d), _mm512_cvtepi32_ps(sum), acc[r].products);
    acc[r].offsets = _mm256_fmadd_ps(_mm256_set1_ps(-32.0f * dx_d), _mm256_cvtepi32_ps(offset_terms), acc[r].offsets);
  }
#elif defined(__AVX2__)
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  __m256i values[8], scale[8];  // per half: the 6-bit values of elements 0-31, 32-63, 64-95, 96-127
  for (int half = 0; half < 2; half++) {
    const uint8_t* ql = w + 64 * half;
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * half));
    __m256i* v = values + 4 * half;
    v[0] = _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), bits45));
    v[1] = _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), bits45));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(h, bits45));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(h, 2), bits45));
    for (int m = 0; m < 4; m++)  // elements 32m..32m+31 of the half: scales sc[8 half + 2m], sc[8 half + 2m + 1]
      scale[4 * half + m] = _mm256_set_m128i(_mm_set1_epi16(sc[8 * half + 2 * m + 1]), _mm_set1_epi16(sc[8 * half + 2 * m]));
  }
  for (int r = 0; r < NR; r++) {
    const int8_t* xq = x.row_block(row0 + r, block);
    __m256i sum = _mm256_setzero_si256();
    for (int half = 0; half < 2; half++)
      for (int m = 0; m < 4; m++) {
        const __m256i products = _mm256_maddubs_epi16(
            values[4 * half + m], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 128 * half + 32 * m)));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(products, scale[4 * half + m]));
      }
    const int16_t* sums = x.block_sums(row0 + r, block);
    int32_t offsets = 0;
    for (int j = 0; j < 16; j++) offsets += sc[j] * sums[j];
    acc[r].sum += x.scale(row0 + r, block) * d * static_cast<float>(hsum_epi32(sum) - 32 * offsets);
  }
#else
  for (int r = 0; r < NR; r++) {
    const int8_t* xq = x.row_block(row0 + r, block);
    int32_t total = 0;
    for (int half = 0; half < 2; half++) {
      const uint8_t* ql = w + 64 * half;
      const uint8_t* qh = w + 128 + 32 * half;
      for (int l = 0; l < 32; l++) {
        const int g = 8 * half + l / 16;
        const int8_t* xh = xq + 128 * half;
        total += sc[g] * (((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32) * xh[l];
        total += sc[g + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32) * xh[l + 32];
        total += sc[g + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * xh[l + 64];
        total += sc[g + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * xh[l + 96];
      }
    }
    acc[r].sum += x.scale(row0 + r, block) * d * static_cast<float>(total);
  }
#endif
}

// out[i, r] = x[i] . W[r] + bias[r] for K-quant weights against 8-bit activations, weight rows split across
// threads, ROW_TILE rows of x per pass over a weight row's blocks (each block unpacked once for them).
template <int F>
void linear_q8k(const float* x, int64_t n, int64_t k, const uint8_t* weight, const float* bias, float* out,
                int64_t rows) {
  const Q8Rows q8(x, n, k);
  const int64_t blocks = k / Q8_BLOCK, row_bytes = blocks * Block<F>::bytes;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    Q8Accumulator acc[ROW_TILE];
    for (int64_t r = begin; r < end; r++) {
      const uint8_t* row = weight + r * row_bytes;
      for (int64_t i = 0; i < n; i += ROW_TILE) {
        const int nr = static_cast<int>(std::min<int64_t>(ROW_TILE, n - i));
        std::fill(acc, acc + ROW_TILE, Q8Accumulator{});
        with_tile(nr, [&](auto tile) {
          constexpr int NR = decltype(tile)::value;
          for (int64_t b = 0; b < blocks; b++) {
            const uint8_t* block = row + b * Block<F>::bytes;
            for (int line = 0; line < Block<F>::bytes; line += 64) __builtin_prefetch(block + PREFETCH_BYTES + line);
            if constexpr (F == Q4_K) dot_q4k_block<NR>(block, q8, i, b, acc);
            else dot_q6k_block<NR>(block, q8, i, b, acc);
          }
        });
        for (int j = 0; j < nr; j++) out[(i + j) * rows + r] = acc[j].total() + (bias ? bias[r] : 0.0f);
      }
    }
  });
}

int64_t block_elems(int64_t format) {
  switch (format) {
    case F32: return Block<F32>::elems;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 32;
  }
}

int64_t block_bytes(int64_t format) {
  switch (format) {
    case F32: return Block<F32>::bytes;
    case BF16: return Block<BF16>::bytes;
    case Q4_0: return Block<Q4_0>::bytes;
    case Q4_1: return Block<Q4_1>::bytes;
    case Q5_0: return Block<Q5_0>::bytes;
    case Q5_1: return Block<Q5_1>::bytes;
    case Q8_0: return Block<Q8_0>::bytes;
    case Q4_K: return Block<Q4_K>::bytes;
    case Q5_K: return Block<Q5_K>::bytes;
    case Q6_K: return Block<Q6_K>::bytes;
  }
  TORCH_CHECK(false, "unsupported weight format ", format);
}

template <typename Fn>
void with_format(int64_t format, Fn&& fn) {
  switch (format) {
    case F32: fn(std::integral_constant<int, F32>{}); break;
    case BF16: fn(std::integral_constant<int, BF16>{}); break;
    case Q4_0: fn(std::integral_constant<int, Q4_0>{}); break;
    case Q4_1: fn(std::integral_constant<int, Q4_1>{}); break;
    case Q5_0: fn(std::integral_constant<int, Q5_0>{}); break;
    case Q5_1: fn(std::integral_constant<int, Q5_1>{}); break;
    case Q8_0: fn(std::integral_constant<int, Q8_0>{}); break;
    case Q4_K: fn(std::integral_constant<int, Q4_K>{}); break;
    case Q5_K: fn(std::integral_constant<int, Q5_K>{}); break;
    case Q6_K: fn(std::integral_constant<int, Q6_K>{}); break;
    default: TORCH_CHECK(false, "unsupported weight format ", format);
  }
}

// out = xf W^T + bias for many activation rows: the weight in fp32 panels of rows (F32 as it is, other formats
// decoded into a buffer, threads splitting the rows), each panel's product by torch's GEMM, written (and rounded to
// out's dtype) into its columns. Each value is the same fp32 dot product as the register tiles', summed in another
// order.
template <int F>
void linear_gemm(const torch::Tensor& xf, const uint8_t* weight, int64_t row_bytes, const torch::Tensor& bias,
                 torch::Tensor& out, int64_t rows) {
  const int64_t k = xf.size(1), panel = std::max<int64_t>(1, GEMM_PANEL_FLOATS / k);
  torch::Tensor decoded;
  if constexpr (F != F32) decoded = torch::empty({std::min(panel, rows), k}, torch::dtype(torch::kFloat32));
  for (int64_t r0 = 0; r0 < rows; r0 += panel) {
    const int64_t count = std::min(panel, rows - r0);
    torch::Tensor w;
    if constexpr (F == F32) {
      w = torch::from_blob(const_cast<uint8_t*>(weight + r0 * row_bytes), {count, k}, torch::dtype(torch::kFloat32));
    } else {
      float* buffer = decoded.data_ptr<float>();
      at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) decode_row<F>(weight + (r0 + r) * row_bytes, k, buffer + r * k);
      });
      w = decoded.narrow(0, 0, count);
    }
    const auto panel_bias = bias.defined() ? c10::optional<torch::Tensor>(bias.narrow(0, r0, count)) : c10::nullopt;
    if (count == rows && out.scalar_type() == torch::kFloat32) {
      at::linear_out(out, xf, w, panel_bias);
    } else {
      out.narrow(1, r0, count).copy_(at::linear(xf, w, panel_bias));
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Python entry points.

// x [n, k] (fp32, or bf16 with bf16 weights) times weight [rows, k] in `format` (fp32/bf16 tensors, or uint8
// [rows, row bytes] of GGUF blocks) plus bias [rows] (fp32 or x's dtype); returns [n, rows] in x's dtype.
torch::Tensor linear(torch::Tensor x, const std::string& format_name, torch::Tensor weight,
                     c10::optional<torch::Tensor> bias, int64_t rows) {
  const int64_t format = format_named(format_name);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "linear: contiguous 2-D x and weight");
  const int64_t n = x.size(0), k = x.size(1);
  TORCH_CHECK(k % block_elems(format) == 0, "linear: ", k, " inputs are not whole blocks of format ", format_name);
  const int64_t row_bytes = k / block_elems(format) * block_bytes(format);
  TORCH_CHECK(weight.numel() * weight.element_size() == rows * row_bytes, "linear: weight size does not match");
  auto out = torch::empty({n, rows}, x.options());
  if (n == 0) return out;
  torch::Tensor bias_f;
  if (bias) bias_f = bias->to(torch::kFloat32).contiguous();
  const float* b = bias ? bias_f.data_ptr<float>() : nullptr;
  float* out_f = out.scalar_type() == torch::kFloat32 ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* out_h = out_f ? nullptr : out.data_ptr<c10::BFloat16>();
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
#ifdef __AVX512BF16__
  if (format == BF16 && x.scalar_type() == torch::kBFloat16 && k % 32 == 0) {
    linear_bf16_native(reinterpret_cast<const uint16_t*>(x.data_ptr()), n, k, reinterpret_cast<const uint16_t*>(w),
                       b, out_f, out_h, rows);
    return out;
  }
#endif
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  if (format == Q4_K || format == Q6_K) {
    TORCH_CHECK(out_f, "linear: K-quant weights take fp32 activations");
    if (format == Q4_K) linear_q8k<Q4_K>(xf.data_ptr<float>(), n, k, w, b, out_f, rows);
    else linear_q8k<Q6_K>(xf.data_ptr<float>(), n, k, w, b, out_f, rows);
    return out;
  }
  with_format(format, [&](auto f) {
    constexpr int F = decltype(f)::value;
    if (n >= TORCH_GEMM_ROWS) linear_gemm<F>(xf, w, row_bytes, bias_f, out, rows);
    else linear_rows<F>(xf.data_ptr<float>(), n, k, w, row_bytes, b, out_f, out_h, rows);
  });
  return out;
}

// The rows `ids` of a weight in `format`, decoded to fp32 [len(ids), cols] (an embedding lookup).
torch::Tensor dequantize_rows(const std::string& format_name, torch::Tensor weight, int64_t cols, torch::Tensor ids) {
  const int64_t format = format_named(format_name);
  const int64_t row_bytes = cols / block_elems(format) * block_bytes(format);
  const auto index = ids.to(torch::kInt64).contiguous();
  const int64_t n = index.numel(), rows = weight.numel() * weight.element_size() / row_bytes;
  auto out = torch::empty({n, cols}, torch::dtype(torch::kFloat32));
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  const int64_t* id = index.data_ptr<int64_t>();
  float* y = out.data_ptr<float>();
  for (int64_t i = 0; i < n; i++) TORCH_CHECK(id[i] >= 0 && id[i] < rows, "dequantize_rows: id out of range");
  with_format(format, [&](auto f) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++) decode_row<decltype(f)::value>(w + id[i] * row_bytes, cols, y + i * cols);
    });
  });
  return out;
}

torch::Tensor dequantize(const std::string& format_name, torch::Tensor weight, int64_t rows, int64_t cols) {
  const int64_t format = format_named(format_name);
  const int64_t row_bytes = cols / block_elems(format) * block_bytes(format);
  TORCH_CHECK(weight.numel() * weight.element_size() == rows * row_bytes, "dequantize: weight size does not match");
  auto out = torch::empty({rows, cols}, torch::dtype(torch::kFloat32));
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  float* y = out.data_ptr<float>();
  with_format(format, [&](auto f) {
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; r++) decode_row<decltype(f)::value>(w + r * row_bytes, cols, y + r * cols);
    });
  });
  return out;
}

inline float load_value(const void* p, bool bf16, int64_t i) {
  return bf16 ? static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]) : static_cast<const float*>(p)[i];
}
inline void store_value(void* p, bool bf16, int64_t i, float v) {
  if (bf16) static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(v); else static_cast<float*>(p)[i] = v;
}

// 16 values of a row that is fp32 or bf16 in memory, widened to fp32; and stored back, rounded to nearest-even bf16.
template <bool BF16>
inline v16f load_row(const void* p, int64_t i) {
  if constexpr (BF16) return widen_bf16(static_cast<const uint16_t*>(p) + i);
  else return load(static_cast<const float*>(p) + i);
}
inline v16f round_bf16(v16f v) {  // fp32 values rounded to the nearest bf16 (ties to even), still as fp32
  v16u bits = (v16u)v;
  bits += 0x7FFF + ((bits >> 16) & 1);
  return (v16f)(bits & 0xFFFF0000u);
}
template <bool BF16>
inline void store_row(void* p, int64_t i, v16f v) {
  if constexpr (BF16) {
    const v16h narrow = __builtin_convertvector(((v16u)round_bf16(v)) >> 16, v16h);
    std::memcpy(static_cast<uint16_t*>(p) + i, &narrow, sizeof narrow);
  } else {
    store(static_cast<float*>(p) + i, v);
  }
}
template <bool BF16>
inline v16f rounded(v16f v) {
  if constexpr (BF16) return round_bf16(v);
  else return v;
}

// RMSNorm as transformers computes it: in fp32, then Llama's w * norm(x) with norm(x) rounded to the model's dtype
// first, or Gemma's (1 + w) * norm(x) in fp32; y holds the result already rounded to the dtype. size % 16 == 0.
template <bool BF16>
void rms_norm_row(const float* h, int64_t size, const void* weight, double eps, bool gemma, float* y) {
  v16f squares = {};
  for (int64_t j = 0; j < size; j += 16) squares += load(h + j) * load(h + j);
  const float inv = 1.0f / std::sqrt(hsum(squares) / size + static_cast<float>(eps));
  for (int64_t j = 0; j < size; j += 16) {
    const v16f w = load_row<BF16>(weight, j), normed = load(h + j) * inv;
    store(y + j, rounded<BF16>(gemma ? normed * (1.0f + w) : w * rounded<BF16>(normed)));
  }
}

// norm(x) for x [n, size]; with `residual`, x += residual first (in place, rounded to x's dtype, as x + out is).
template <bool BF16>
void rms_norm_rows(void* x, const void* add, void* out, int64_t n, int64_t size, const void* weight, double eps,
                   bool gemma) {
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> h(size), y(size);
    for (int64_t i = begin; i < end; i++) {
      for (int64_t j = 0; j < size; j += 16) {
        v16f v = load_row<BF16>(x, i * size + j);
        if (add) {
          v = rounded<BF16>(v + load_row<BF16>(add, i * size + j));
          store_row<BF16>(x, i * size + j, v);
        }
        store(h.data() + j, v);
      }
      rms_norm_row<BF16>(h.data(), size, weight, eps, gemma, y.data());
      for (int64_t j = 0; j < size; j += 16) store_row<BF16>(out, i * size + j, load(y.data() + j));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
                       bool gemma) {
  TORCH_CHECK(x.is_contiguous() && weight.scalar_type() == x.scalar_type(), "rms_norm: contiguous x, same dtypes");
  const int64_t size = x.size(-1), n = x.numel() / size;
  TORCH_CHECK(size % 16 == 0, "rms_norm: a width of whole 16-value vectors");
  auto out = torch::empty_like(x);
  torch::Tensor add;
  if (residual) add = residual->contiguous();
  const void* added = residual ? add.data_ptr() : nullptr;
  if (x.scalar_type() == torch::kBFloat16)
    rms_norm_rows<true>(x.data_ptr(), added, out.data_ptr(), n, size, weight.data_ptr(), eps, gemma);
  else
    rms_norm_rows<false>(x.data_ptr(), added, out.data_ptr(), n, size, weight.data_ptr(), eps, gemma);
  return out;
}

// act(gate) * up for gate_up [n, 2I] (gate first): SiLU, or GELU's tanh form (tanh z = 1 - 2 / (1 + e^2z)); the
// activation rounded to the dtype before the product, as eager rounds it.
template <bool BF16>
void gated_rows(const void* in, void* out, int64_t n, int64_t inner, bool gelu) {
  at::parallel_for(0, n * (inner / 16), 64, [&](int64_t begin, int64_t end) {
    for (int64_t piece = begin; piece < end; piece++) {
      const int64_t i = piece / (inner / 16), j = piece % (inner / 16) * 16;
      const v16f g = load_row<BF16>(in, i * 2 * inner + j), u = load_row<BF16>(in, i * 2 * inner + inner + j);
      v16f a;
      if (gelu) {
        const v16f z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        a = 0.5f * g * (2.0f - 2.0f / (1.0f + vexp(2.0f * z)));
      } else {
        a = g / (1.0f + vexp(-g));
      }
      store_row<BF16>(out, i * inner + j, rounded<BF16>(a) * u);
    }
  });
}

torch::Tensor gated_activation(torch::Tensor gate_up, bool gelu) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(1) % 32 == 0, "gated_activation: contiguous, 16-value halves");
  const int64_t n = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = torch::empty({n, inner}, gate_up.options());
  if (gate_up.scalar_type() == torch::kBFloat16) gated_rows<true>(gate_up.data_ptr(), out.data_ptr(), n, inner, gelu);
  else gated_rows<false>(gate_up.data_ptr(), out.data_ptr(), n, inner, gelu);
  return out;
}

// The rows of a batch of sequences scored in one forward: sequence b's n_b rows follow those of the sequences before
// it, and its keys and values go to its own cache from slot starts[b].
struct RaggedRows {
  std::vector<int64_t> sequence, offset;  // per row: its sequence, and its index among that sequence's rows
  std::vector<int64_t> first;             // per sequence: its first row (and the total at the end)
  explicit RaggedRows(const std::vector<int64_t>& counts) : first(counts.size() + 1, 0) {
    for (size_t b = 0; b < counts.size(); b++) {
      first[b + 1] = first[b] + counts[b];
      for (int64_t i = 0; i < counts[b]; i++) {
        sequence.push_back(static_cast<int64_t>(b));
        offset.push_back(i);
      }
    }
  }
  int64_t total() const { return first.back(); }
  int64_t count(int64_t b) const { return first[b + 1] - first[b]; }
};

template <bool BF16>
void rope_store_rows(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                     const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                     const std::vector<int64_t>& starts, const RaggedRows& ragged, torch::Tensor& q, int64_t heads,
                     int64_t kv_heads, const c10::optional<torch::Tensor>& q_norm,
                     const c10::optional<torch::Tensor>& k_norm, double eps, bool gemma) {
  const int64_t n = qkv.size(0), d = k_caches[0].size(2), rotary = cos.size(1), half = rotary / 2;
  const int64_t width = qkv.size(1);
  const bool vector_rotation = half % 16 == 0;  // whole 16-value vectors on both sides of the rotation
  at::parallel_for(0, n * (heads + 2 * kv_heads), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(d), y(d);
    for (int64_t task = begin; task < end; task++) {
      const int64_t t = task / (heads + 2 * kv_heads), h = task % (heads + 2 * kv_heads);
      const int64_t b = ragged.sequence[t], i = ragged.offset[t], slot = starts[b] + i;
      const int64_t source = t * width + h * d;
      if (h >= heads + kv_heads) {  // v: stored as it is
        const torch::Tensor& v_cache = v_caches[b];
        void* target = static_cast<char*>(v_cache.data_ptr()) +
                       ((h - heads - kv_heads) * v_cache.stride(0) + slot * d) * v_cache.element_size();
        std::memcpy(target, static_cast<const char*>(qkv.data_ptr()) + source * qkv.element_size(),
                    d * qkv.element_size());
        continue;
      }
      if (d % 16 == 0) {
        for (int64_t j = 0; j < d; j += 16) store(x.data() + j, load_row<BF16>(qkv.data_ptr(), source + j));
      } else {
        for (int64_t j = 0; j < d; j++) x[j] = load_value(qkv.data_ptr(), BF16, source + j);
      }
      const bool is_q = h < heads;
      const auto& norm = is_q ? q_norm : k_norm;
      if (norm) {
        rms_norm_row<BF16>(x.data(), d, norm->data_ptr(), eps, gemma, y.data());
        x = y;
      }
      y = x;  // dimensions past `rotary` pass through (partial rotary)
      const void* c = cos.data_ptr();
      const void* s = sin.data_ptr();
      const int64_t row = t * rotary;
      if (vector_rotation) {
        for (int64_t j = 0; j < half; j += 16) {
          const v16f a = load(x.data() + j), b = load(x.data() + j + half);
          store(y.data() + j, a * load_row<BF16>(c, row + j) - b * load_row<BF16>(s, row + j));
          store(y.data() + j + half, b * load_row<BF16>(c, row + j + half) + a * load_row<BF16>(s, row + j + half));
        }
      } else {
        for (int64_t j = 0; j < half; j++) {
          y[j] = x[j] * load_value(c, BF16, row + j) - x[j + half] * load_value(s, BF16, row + j);
          y[j + half] = x[j + half] * load_value(c, BF16, row + j + half) + x[j] * load_value(s, BF16, row + j + half);
        }
      }
      void* target = is_q ? q.data_ptr() : k_caches[b].data_ptr();
      // q: sequence b's block [heads, n_b, d] starts at row heads * first[b]
      const int64_t offset = is_q ? (heads * ragged.first[b] + h * ragged.count(b) + i) * d
                                  : (h - heads) * k_caches[b].stride(0) + slot * d;
      if (d % 16 == 0) {
        for (int64_t j = 0; j < d; j += 16) store_row<BF16>(target, offset + j, load(y.data() + j));
      } else {
        for (int64_t j = 0; j < d; j++) store_value(target, BF16, offset + j, y[j]);
      }
    }
  });
}

void check_caches(const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                  const std::vector<int64_t>& counts, torch::ScalarType dtype, int64_t d, const char* name) {
  TORCH_CHECK(!k_caches.empty() && k_caches.size() == v_caches.size() && k_caches.size() == counts.size(), name,
              ": one cache and one row count per sequence");
  for (size_t b = 0; b < k_caches.size(); b++) {
    const auto &k = k_caches[b], &v = v_caches[b];
    TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(2) == d && v.size(2) == d && k.stride(2) == 1 &&
                k.stride(1) == d && v.stride(1) == d && v.stride(2) == 1 && k.size(0) == k_caches[0].size(0),
                name, ": cache layout");
    TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, name, ": caches in the rows' dtype");
  }
}

// q, k, v out of qkv [n, (heads + 2 kv_heads) * d], the rows of several sequences one after another (`counts` rows
// each): q and k RMS-normed per head if given (Qwen3, Gemma 3), rotated over their first `rotary` dims with cos/sin
// [n, rotary] (transformers' rotate_half); sequence b's k and v written to slots starts[b].. of its caches
// k_caches[b]/v_caches[b] [kv_heads, slots, d] (in qkv's dtype). Returns q [n * heads, d]: sequence b's block
// [heads, n_b, d] from row heads * (the rows before it).
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_caches,
                         std::vector<torch::Tensor> v_caches, std::vector<int64_t> starts, std::vector<int64_t> counts,
                         int64_t heads, int64_t kv_heads, c10::optional<torch::Tensor> q_norm,
                         c10::optional<torch::Tensor> k_norm, double eps, bool gemma) {
  const int64_t n = qkv.size(0);
  TORCH_CHECK(!k_caches.empty(), "rope_store: no cache");
  const int64_t d = k_caches[0].size(2);
  const RaggedRows ragged(counts);
  check_caches(k_caches, v_caches, counts, qkv.scalar_type(), d, "rope_store");
  TORCH_CHECK(starts.size() == counts.size() && ragged.total() == n, "rope_store: rows and counts");
  TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * d, "rope_store: qkv shape");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && cos.is_contiguous() && sin.is_contiguous() &&
              cos.size(0) == n, "rope_store: tables [n, rotary] in qkv's dtype");
  for (size_t b = 0; b < counts.size(); b++)
    TORCH_CHECK(starts[b] >= 0 && starts[b] + counts[b] <= k_caches[b].size(1), "rope_store: cache overflow");
  auto q = torch::empty({n * heads, d}, qkv.options());
  if (qkv.scalar_type() == torch::kBFloat16)
    rope_store_rows<true>(qkv, cos, sin, k_caches, v_caches, starts, ragged, q, heads, kv_heads, q_norm, k_norm, eps,
                          gemma);
  else
    rope_store_rows<false>(qkv, cos, sin, k_caches, v_caches, starts, ragged, q, heads, kv_heads, q_norm, k_norm, eps,
                           gemma);
  return q;
}

// Row helpers for any length d (16-float vectors, then a scalar tail).
inline float dot_row(const float* a, const float* b, int64_t d) {
  v16f acc = {};
  int64_t e = 0;
  for (; e + 16 <= d; e += 16) acc += load(a + e) * load(b + e);
  float s = hsum(acc);
  for (; e < d; e++) s += a[e] * b[e];
  return s;
}
// Slot j of a [slots, d] cache row block as fp32: the row itself, or widened from bf16 into `buffer`.
inline const float* cache_row(const torch::Tensor& cache, int64_t head, int64_t j, int64_t d, bool bf16,
                              float* buffer) {
  if (!bf16) return cache.data_ptr<float>() + head * cache.stride(0) + j * d;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(cache.data_ptr()) + head * cache.stride(0) + j * d;
  int64_t e = 0;
  for (; e + 16 <= d; e += 16) store(buffer + e, widen_bf16(src + e));
  for (; e < d; e++) {
    const uint32_t bits = static_cast<uint32_t>(src[e]) << 16;
    std::memcpy(buffer + e, &bits, 4);
  }
  return buffer;
}

// From this many query rows per KV head (trees, prefill; GQA groups) a chunk's scores come from one matrix product
// (torch's own GEMM, single-threaded inside the task) instead of a dot product per row and key. Measured on
// smollm2 (3 KV heads of 3 query heads) at 7,680 keys: 6 rows 0.87 ms a layer by dot products, 0.42 by the GEMM;
// 3 rows no faster by the GEMM, and slower on short contexts.
#ifndef GEMM_ROWS
#define GEMM_ROWS 4
#endif

constexpr int64_t ATTENTION_CHUNK = 256;
constexpr int64_t MAX_SCORES = 1 << 18;  // a task's scores buffer: 1 MB

// One sequence's share of a ragged attention call: its rows, keys, mask and where its tasks and running state sit.
struct AttentionPart {
  int64_t rows = 0;            // group * n_b: per KV head, row g * n_b + i is head kv * group + g, query i
  int64_t length = 0;          // keys
  int64_t chunk = 0, chunks = 0;
  int64_t first_task = 0;      // its tasks: kv_heads * chunks from here
  int64_t first_state = 0;     // its running max/sum entries: kv_heads * chunks * rows from here
  const float* q = nullptr;    // [heads, n_b, d] in fp32
  const float* mask = nullptr; // additive, or null: every key visible
  int64_t mask_row = 0, mask_head = 0;  // the mask's row stride, and KV head kv's offset (0 where heads share one)
};

// softmax(softcap(q k^T * scale) + mask) v for each of several sequences over its own keys: q [n * heads, d] as
// rope_store returns it (sequence b's block [heads, n_b, d], n_b = counts[b]) over the first lengths[b] slots of
// k_caches[b]/v_caches[b] [kv_heads, slots, d] (heads share a KV head in groups, as GQA); masks[b] additive,
// [n_b, >= length] or one per KV head [kv_heads, n_b, >= length], or an empty tensor (every key visible);
// softcap(s) = cap tanh(s / cap) where cap > 0 (Gemma 2), else s. Each (sequence, KV head, chunk of keys) is a task
// holding its rows' running max, sum and weighted values; the chunks of a head are merged at the end. Returns
// [n, heads * d] in q's dtype, the sequences' rows one after another.
torch::Tensor attention(torch::Tensor q, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                        std::vector<int64_t> counts, std::vector<int64_t> lengths, std::vector<torch::Tensor> masks,
                        double scale, double softcap) {
  const int64_t d = q.size(1), kv_heads = k_caches.empty() ? 1 : k_caches[0].size(0);
  const RaggedRows ragged(counts);
  const int64_t n = ragged.total(), sequences = static_cast<int64_t>(counts.size());
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.size(0) % std::max<int64_t>(n, 1) == 0, "attention: q layout");
  const int64_t heads = n > 0 ? q.size(0) / n : 0, group = heads / kv_heads;
  check_caches(k_caches, v_caches, counts, k_caches[0].scalar_type(), d, "attention");
  TORCH_CHECK(lengths.size() == counts.size() && masks.size() == counts.size(), "attention: one length and mask each");
  const bool cache_bf16 = k_caches[0].scalar_type() == torch::kBFloat16;
  const auto qf = q.to(torch::kFloat32).contiguous();
  std::vector<torch::Tensor> float_masks(sequences);
  std::vector<AttentionPart> parts(sequences);
  const int64_t threads = at::get_num_threads();
  // chunks of at least ATTENTION_CHUNK keys (below that a split costs more, a merge pass, than it spreads), and of
  // at most MAX_SCORES scores per task; a batch spreads over its sequences before it splits their keys
  const int64_t per_head = std::max<int64_t>(1, (2 * threads + kv_heads * sequences - 1) / (kv_heads * sequences));
  int64_t tasks = 0, states = 0, widest = 0;
  for (int64_t b = 0; b < sequences; b++) {
    AttentionPart& part = parts[b];
    part.rows = group * counts[b];
    part.length = lengths[b];
    TORCH_CHECK(part.length >= 0 && part.length <= k_caches[b].size(1), "attention: length beyond the cache");
    part.q = qf.data_ptr<float>() + heads * ragged.first[b] * d;
    if (masks[b].numel() > 0) {
      float_masks[b] = masks[b].to(torch::kFloat32);
      const torch::Tensor& m = float_masks[b];
      const int64_t dims = m.dim();
      TORCH_CHECK((dims == 2 || (dims == 3 && m.size(0) == kv_heads)) && m.size(dims - 2) == counts[b] &&
                  m.size(dims - 1) >= part.length && m.stride(dims - 1) == 1, "attention: mask shape");
      part.mask = m.data_ptr<float>();
      part.mask_row = m.stride(dims - 2);
      part.mask_head = dims == 3 ? m.stride(0) : 0;
    }
    const int64_t largest = std::max<int64_t>(ATTENTION_CHUNK, MAX_SCORES / std::max<int64_t>(part.rows, 1));
    int64_t chunk = std::min<int64_t>(largest, std::max<int64_t>(ATTENTION_CHUNK, (part.length + per_head - 1) / per_head));
    part.chunk = (chunk + 15) / 16 * 16;
    part.chunks = (part.length + part.chunk - 1) / part.chunk;
    part.first_task = tasks;
    part.first_state = states;
    tasks += kv_heads * part.chunks;
    states += kv_heads * part.chunks * part.rows;
    widest = std::max(widest, part.rows * part.chunk);
  }
  std::vector<int64_t> task_part(tasks);
  for (int64_t b = 0; b < sequences; b++)
    std::fill(task_part.begin() + parts[b].first_task,
              task_part.begin() + parts[b].first_task + kv_heads * parts[b].chunks, b);
  std::vector<float> run_max(states), run_sum(states), run_acc(states * d);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(widest), key(d);
    std::vector<float> value_block(16 * d);
    for (int64_t task = begin; task < end; task++) {
      const int64_t b = task_part[task];
      const AttentionPart& part = parts[b];
      const torch::Tensor &k_cache = k_caches[b], &v_cache = v_caches[b];
      const int64_t local = task - part.first_task, rows = part.rows, chunk = part.chunk, n_b = counts[b];
      const int64_t kv = local / part.chunks, j0 = (local % part.chunks) * chunk;
      const int64_t j1 = std::min(part.length, j0 + chunk), span = j1 - j0;
      const float* qh = part.q + kv * rows * d;
      const float* head_mask = part.mask ? part.mask + kv * part.mask_head : nullptr;
      if (rows < GEMM_ROWS) {
        for (int64_t j = j0; j < j1; j++) {
          const float* kj = cache_row(k_cache, kv, j, d, cache_bf16, key.data());
          for (int64_t r = 0; r < rows; r++) {
            float score = dot_row(qh + r * d, kj, d) * fscale;
            if (cap > 0.0f) score = cap * std::tanh(score / cap);
            if (head_mask) score += head_mask[(r % n_b) * part.mask_row + j];
            scores[r * chunk + (j - j0)] = score;
          }
        }
      } else {  // q [rows, d] times the chunk's keys [span, d]^T in fp32 (a bf16 cache's keys widened first)
        const torch::Tensor q_rows = torch::from_blob(const_cast<float*>(qh), {rows, d}, torch::kFloat32);
        const torch::Tensor products =
            at::linear(q_rows, k_cache[kv].narrow(0, j0, span).to(torch::kFloat32)).contiguous();
        const float* product = products.data_ptr<float>();
        for (int64_t r = 0; r < rows; r++) {
          const float* row_mask = head_mask ? head_mask + (r % n_b) * part.mask_row + j0 : nullptr;
          float* out = scores.data() + r * chunk;
          if (cap > 0.0f) {
            for (int64_t j = 0; j < span; j++)
              out[j] = cap * std::tanh(product[r * span + j] * fscale / cap) + (row_mask ? row_mask[j] : 0.0f);
            continue;
          }
          int64_t j = 0;
          for (; j + 16 <= span; j += 16)
            store(out + j, load(product + r * span + j) * fscale + (row_mask ? load(row_mask + j) : v16f{}));
          for (; j < span; j++) out[j] = product[r * span + j] * fscale + (row_mask ? row_mask[j] : 0.0f);
        }
      }
      const int64_t state = part.first_state + local * rows;
      float* acc_out = run_acc.data() + state * d;
      std::fill(acc_out, acc_out + rows * d, 0.0f);
      for (int64_t r = 0; r < rows; r++) {
        float* row = scores.data() + r * chunk;
        v16f tops = splat(-std::numeric_limits<float>::infinity());
        int64_t jt = 0;
        for (; jt + 16 <= span; jt += 16) tops = load(row + jt) > tops ? load(row + jt) : tops;
        float top = -std::numeric_limits<float>::infinity();
        for (int i = 0; i < 16; i++) top = std::max(top, tops[i]);
        for (; jt < span; jt++) top = std::max(top, row[jt]);
        float total = 0.0f;
        if (top != -std::numeric_limits<float>::infinity()) {
          int64_t j = 0;
          for (; j + 16 <= span; j += 16) {
            const v16f p = vexp(load(row + j) - top);
            store(row + j, p);
            total += hsum(p);
          }
          for (; j < span; j++) { row[j] = std::exp(row[j] - top); total += row[j]; }
        } else {
          std::fill(row, row + span, 0.0f);
        }
        run_max[state + r] = top;
        run_sum[state + r] = total;
      }
      // acc_r += sum_j p_rj v_j, 16 keys at a time: each accumulator slice is loaded and stored once per block
      for (int64_t jb = j0; jb < j1; jb += 16) {
        const int64_t count = std::min<int64_t>(16, j1 - jb);
        for (int64_t j = 0; j < count; j++) {
          const float* vj = cache_row(v_cache, kv, jb + j, d, cache_bf16, value_block.data() + j * d);
          if (vj != value_block.data() + j * d) std::copy(vj, vj + d, value_block.data() + j * d);
        }
        int64_t e = 0;
        for (; e + 16 <= d; e += 16) {  // one 16-wide slice of the 16 values in registers, every row over it
          v16f slice[16];
          for (int64_t j = 0; j < count; j++) slice[j] = load(value_block.data() + j * d + e);
          for (int64_t r = 0; r < rows; r++) {
            const float* p = scores.data() + r * chunk + (jb - j0);
            v16f a = load(acc_out + r * d + e);
            for (int64_t j = 0; j < count; j++) a += p[j] * slice[j];
            store(acc_out + r * d + e, a);
          }
        }
        for (; e < d; e++)
          for (int64_t r = 0; r < rows; r++) {
            const float* p = scores.data() + r * chunk + (jb - j0);
            for (int64_t j = 0; j < count; j++) acc_out[r * d + e] += p[j] * value_block[j * d + e];
          }
      }
    }
  });
  auto out = torch::empty({n, heads * d}, q.options());
  const bool out_bf16 = q.scalar_type() == torch::kBFloat16;
  // every (query row, head): row t's heads in order; the merge reads each of its chunks' running state
  at::parallel_for(0, n * heads, 64, [&](int64_t begin, int64_t end) {  // a few rows: no fork
    std::vector<float> merged(d);
    for (int64_t th = begin; th < end; th++) {
      const int64_t t = th / heads, head = th % heads, b = ragged.sequence[t], i = ragged.offset[t];
      const AttentionPart& part = parts[b];
      const int64_t kv = head / group, r = (head % group) * counts[b] + i;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < part.chunks; c++)
        top = std::max(top, run_max[part.first_state + (kv * part.chunks + c) * part.rows + r]);
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t c = 0; c < part.chunks; c++) {
        const int64_t state = part.first_state + (kv * part.chunks + c) * part.rows + r;
        const float part_max = run_max[state];
        if (part_max == -std::numeric_limits<float>::infinity()) continue;
        const float weight = std::exp(part_max - top);
        total += weight * run_sum[state];
        const float* acc = run_acc.data() + state * d;
        for (int64_t e = 0; e < d; e++) merged[e] += weight * acc[e];
      }
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t e = 0; e < d; e++) store_value(out.data_ptr(), out_bf16, t * heads * d + head * d + e, merged[e] * inv);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("formats", [] { return std::vector<std::string>(FORMAT_NAMES, FORMAT_NAMES + FORMAT_COUNT); });
  m.def("linear", &linear);
  m.def("dequantize", &dequantize);
  m.def("dequantize_rows", &dequantize_rows);
  m.def("rms_norm", &rms_norm);
  m.def("gated_activation", &gated_activation);
  m.def("rope_store", &rope_store);
  m.def("attention", &attention);
}
