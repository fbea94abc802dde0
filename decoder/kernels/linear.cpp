// The matmul kernels of decoder/kernels/linear.h: every weight format's blocks decoded in registers as they stream
// (written after ggml's dequantize_row_*, so that a block means exactly what llama.cpp reads from the same file),
// dotted with a few activation rows per pass, or with register tiles for more; K-quants against 8-bit activations.

#include "linear.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "simd.h"

namespace specplan_kernels {
namespace {

// Rows of activations dotted with a weight row per pass over it, their accumulators in registers: 8 x 2 fit
// AVX-512's 32 registers. Up to direct_rows(format) rows (decoding, token trees) take passes of ROW_TILE rows
// over each weight row, a block format's blocks decoded in registers once per pass; more (prefill chunks) read
// TILE_W weight rows as fp32 (decoded once into a buffer) and run register tiles over them. The limits are
// measured (matmul passes over smollm2-135m's layers on a 2-core EPYC, bench/kernel_variants.py): fp32 rows
// stream best in tiles from 5 rows on, bf16 from 9, decoded blocks from 17 (from 32 rows, decoding once beats a
// pass per 8). With AVX2's 16 registers fp32 and the native blocks take passes of up to 5 rows (two ymm accumulators
// per row beside a block's four widened pieces), up to 64 rows: smollm2's matmul passes of 6-16 rows ran 2-3x faster
// so than in register tiles or torch's GEMM, and its forwards of 24-48 rows faster too (bench/kernel_variants.py
// forward; TORCH_GEMM_ROWS_F32 in cpu_kernels.cpp). A pass costs about as much for 1 row as for 5 there, so a
// matmul's rows are shared evenly among the passes it needs (BALANCED_PASSES): against passes of 4, Q4_1, Q5_0 and
// Q8_0 passes of 5 rows 28-31% faster, 9 and 10 rows 15-21%, every other count up to 16 within 2%
// (bench/kernel_variants.py row-tile, a 2-core Zen 2 EPYC).
#ifdef __AVX512F__
// On an Intel Xeon with AMX, with the fp32 rows prefetched (AVX512_F32_PREFETCH_BYTES), direct passes beat the tiles up
// to 16 rows: smollm2's forward of 6-12 rows 1.1-1.3x faster (bench/kernel_variants.py forward
// AVX512_F32_PREFETCH_BYTES=4096,AVX512_DIRECT_ROWS_F32=8 ...=16 ...=24 rows=1,2,3,4,6,8,12,16,20,24).
#ifndef AVX512_DIRECT_ROWS_F32
#ifdef __AMX_TILE__
#define AVX512_DIRECT_ROWS_F32 16
#else
#define AVX512_DIRECT_ROWS_F32 4
#endif
#endif
constexpr int ROW_TILE = 8;
constexpr int64_t DIRECT_ROWS_F32 = AVX512_DIRECT_ROWS_F32, DIRECT_ROWS_BF16 = 8, DIRECT_ROWS_BLOCKS = 16;
#else
#ifndef AVX2_ROW_TILE
#define AVX2_ROW_TILE 5
#endif
#ifndef AVX2_BALANCED_PASSES
#define AVX2_BALANCED_PASSES 1
#endif
#ifndef AVX2_DIRECT_ROWS_F32
#define AVX2_DIRECT_ROWS_F32 64
#endif
constexpr int ROW_TILE = AVX2_ROW_TILE;
constexpr int64_t DIRECT_ROWS_F32 = AVX2_DIRECT_ROWS_F32, DIRECT_ROWS_BF16 = 2, DIRECT_ROWS_BLOCKS = 2;
#endif
constexpr bool BALANCED_PASSES =
#if !defined(__AVX512F__) && AVX2_BALANCED_PASSES
    true;
#else
    false;
#endif
// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 rows on AVX2 take their native ymm dot products in direct passes up to fp32's row
// limit (dot_blocks' 16-float vectors ran Q4_0 7-12x slower on an AVX2 build: 1-8 rows over 8960 x 1536 matrices, the
// log's 2026-12-03 afternoon entry)
constexpr bool NATIVE_BLOCKS =
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    true;
#else
    false;
#endif
constexpr bool native_avx2(int64_t format) {
  return NATIVE_BLOCKS && (format == Q4_0 || format == Q4_1 || format == Q5_0 || format == Q5_1 || format == Q8_0);
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

// Block formats decode slowly enough that the hardware prefetcher alone leaves DRAM bandwidth unused (Q6_K streamed
// at 14 GB/s without this); the decode loop asks for the bytes this far ahead.
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
// fp32 rows stream with no decoding between the loads: on AVX2 a short distance streams one-row passes over
// smollm2's weights 5-10% faster than 4096, at 90-100% of the rate torch sums them (bench/kernel_variants.py
// prefetch-f32 256 512 4096)
#ifndef F32_PREFETCH_BYTES
#define F32_PREFETCH_BYTES 256
#endif
// With AVX-512 the hardware prefetcher alone leaves fp32 passes short of DRAM's rate. On an Intel Xeon with AMX, rows
// asked for 4096 bytes ahead stream at torch's one-row rate and 1.3-1.5x faster than without for 2-4 rows (smollm2's
// forward of 1-4 rows 1.2-1.4x faster); on a 2-core AMD EPYC, 2048 bytes ahead run its forward of one row 1.09-1.15x
// and of 4 rows 1.0-1.17x faster, of 2 rows 3% slower (bench/kernel_variants.py forward
// AVX512_F32_PREFETCH_BYTES=0 AVX512_F32_PREFETCH_BYTES=2048 AVX512_F32_PREFETCH_BYTES=4096 rows=1,2,3,4).
#ifndef AVX512_F32_PREFETCH_BYTES
#ifdef __AMX_TILE__
#define AVX512_F32_PREFETCH_BYTES 4096
#else
#define AVX512_F32_PREFETCH_BYTES 2048
#endif
#endif

template <int NR>
inline void dot_f32(const float* w, const float* x, int64_t ldx, int64_t k, float* out) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  // AVX2: native ymm accumulators (GCC's 16-float vectors compile to a far slower loop there: a one-token smollm2
  // forward ran 1.3x slower), ACC independent ones per row, as many as the 16 registers hold beside the weight's.
  constexpr int ACC = NR <= 2 ? 4 : 2;
  constexpr int STEP = 8 * ACC;
  __m256 acc[NR][ACC];
  for (int r = 0; r < NR; r++)
    for (int a = 0; a < ACC; a++) acc[r][a] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + STEP <= k; c += STEP) {
    for (int line = 0; line < STEP * 4; line += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(w + c) + F32_PREFETCH_BYTES + line);
    __m256 wv[ACC];
    for (int a = 0; a < ACC; a++) wv[a] = _mm256_loadu_ps(w + c + 8 * a);
    for (int r = 0; r < NR; r++)
      for (int a = 0; a < ACC; a++)
        acc[r][a] = _mm256_fmadd_ps(wv[a], _mm256_loadu_ps(x + r * ldx + c + 8 * a), acc[r][a]);
  }
  for (int r = 0; r < NR; r++) {
    __m256 sum = acc[r][0];
    for (int a = 1; a < ACC; a++) sum = _mm256_add_ps(sum, acc[r][a]);
    float total = hsum8(sum);
    for (int64_t t = c; t < k; t++) total += w[t] * x[r * ldx + t];
    out[r] = total;
  }
#else
  v16f acc[NR][2] = {};
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
#if AVX512_F32_PREFETCH_BYTES > 0
    __builtin_prefetch(reinterpret_cast<const char*>(w + c) + AVX512_F32_PREFETCH_BYTES);
    __builtin_prefetch(reinterpret_cast<const char*>(w + c) + AVX512_F32_PREFETCH_BYTES + 64);
#endif
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
#endif
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

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks widened into four 8-lane ymm pieces (dot_blocks' 16-float vectors compile
// to a slow loop on AVX2), decoded as dot_blocks decodes them: Q4_0 y = d (q - 8), Q4_1 y = d q + m,
// Q5_0 y = d (q - 16), Q5_1 y = d q + m, Q8_0 y = d q.
template <int F> inline void widen_avx2(const uint8_t* block, __m256 w[4]);

// A block's 16 bytes of nibbles as four 8-value pieces of int32: elements 8a .. 8a + 7 (each half of the bytes
// widened once, its low nibbles masked and its high ones shifted down: fewer shuffles than splitting the nibbles
// into bytes first, on a compute-bound one-row pass)
inline void nibble_values(const uint8_t* nibbles, __m256i values[4]) {
  const __m256i low_nibble = _mm256_set1_epi32(15);
  const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(nibbles)));
  const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(nibbles + 8)));
  values[0] = _mm256_and_si256(first, low_nibble), values[1] = _mm256_and_si256(second, low_nibble);
  values[2] = _mm256_srli_epi32(first, 4), values[3] = _mm256_srli_epi32(second, 4);
}

// Piece a's values with their fifth bits (bit j of qh for element j)
inline __m256i with_fifth_bits(__m256i values, uint32_t qh, int a) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i fifth = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(qh)), _mm256_add_epi32(lane, _mm256_set1_epi32(8 * a))),
      _mm256_set1_epi32(1));
  return _mm256_or_si256(values, _mm256_slli_epi32(fifth, 4));
}

template <> inline void widen_avx2<Q4_0>(const uint8_t* block, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(block));
  __m256i values[4];
  nibble_values(block + 2, values);
  for (int a = 0; a < 4; a++)
    w[a] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(values[a], _mm256_set1_epi32(8))), d);
}

template <> inline void widen_avx2<Q5_1>(const uint8_t* block, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(block)), m = _mm256_set1_ps(half_at(block + 2));
  uint32_t qh; std::memcpy(&qh, block + 4, 4);
  __m256i values[4];
  nibble_values(block + 8, values);
  for (int a = 0; a < 4; a++) w[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(with_fifth_bits(values[a], qh, a)), d, m);
}

template <> inline void widen_avx2<Q4_1>(const uint8_t* block, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(block)), m = _mm256_set1_ps(half_at(block + 2));
  __m256i values[4];
  nibble_values(block + 4, values);
  for (int a = 0; a < 4; a++) w[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(values[a]), d, m);
}

template <> inline void widen_avx2<Q5_0>(const uint8_t* block, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(block));
  uint32_t qh; std::memcpy(&qh, block + 2, 4);
  __m256i values[4];
  nibble_values(block + 6, values);
  for (int a = 0; a < 4; a++) {
    const __m256i q = _mm256_sub_epi32(with_fifth_bits(values[a], qh, a), _mm256_set1_epi32(16));
    w[a] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
  }
}

template <> inline void widen_avx2<Q8_0>(const uint8_t* block, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(block));
  for (int a = 0; a < 4; a++) {
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * a)));
    w[a] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
  }
}

// A Q4_1, Q5_0 or Q8_0 row against NR activation rows on native ymm registers: four accumulators per row for one or two
// rows, two for three or four (the 16 registers).
template <int F, int NR>
inline void dot_blocks_avx2(const uint8_t* row, const float* x, int64_t ldx, int64_t k, float* out) {
  constexpr int ACC = NR <= 2 ? 4 : 2;
  __m256 acc[NR][ACC];
  for (int r = 0; r < NR; r++)
    for (int a = 0; a < ACC; a++) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / 32; b++) {
    const uint8_t* block = row + b * Block<F>::bytes;
    __builtin_prefetch(block + PREFETCH_BYTES);
    __m256 w[4];
    widen_avx2<F>(block, w);
    for (int r = 0; r < NR; r++)
      for (int a = 0; a < 4; a++)
        acc[r][a % ACC] = _mm256_fmadd_ps(w[a], _mm256_loadu_ps(x + r * ldx + b * 32 + 8 * a), acc[r][a % ACC]);
  }
  for (int r = 0; r < NR; r++) {
    __m256 sum = acc[r][0];
    for (int a = 1; a < ACC; a++) sum = _mm256_add_ps(sum, acc[r][a]);
    out[r] = hsum8(sum);
  }
}
#endif

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
inline void with_tile(int nr, Fn&& fn) { with_count<ROW_TILE>(nr, fn); }

// The activation rows of the next pass over a weight row, `done` of n scored: ROW_TILE, or with BALANCED_PASSES the
// passes ROW_TILE at a time takes, their rows shared out evenly (AVX2, 6 rows: 3 + 3, not 5 + 1; a pass of 1 row
// costs most of a pass of 5, and 3 + 3 what 4 + 2 did).
inline int pass_rows(int64_t n, int64_t done) {
  const int64_t left = n - done;
  if constexpr (!BALANCED_PASSES) return static_cast<int>(std::min<int64_t>(ROW_TILE, left));
  const int64_t passes = (left + ROW_TILE - 1) / ROW_TILE;
  return static_cast<int>((left + passes - 1) / passes);
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
  if (n <= (F == F32 || native_avx2(F) ? DIRECT_ROWS_F32 : DIRECT_ROWS_BLOCKS)) {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      float part[ROW_TILE];
      for (int64_t r = begin; r < end; r++) {
        const uint8_t* row = weight + r * row_bytes;
        for (int64_t i = 0, nr = 0; i < n; i += nr) {
          nr = pass_rows(n, i);
          with_tile(nr, [&](auto tile) {
            constexpr int NR = decltype(tile)::value;
            if constexpr (F == F32) dot_f32<NR>(reinterpret_cast<const float*>(row), x + i * k, k, k, part);
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
            else if constexpr (native_avx2(F)) dot_blocks_avx2<F, NR>(row, x + i * k, k, k, part);
#endif
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
void bf16_native_rows(const uint16_t* x, int64_t n, int64_t k, const uint16_t* weight, const float* bias,
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
// Activation rows per pass over a K-quant weight row: each row's integer sum takes one register while a chunk of the
// block is unpacked once for all of them (qwen2.5-coder-1.5b's K-quant matrices, bench/kernel_variants.py q8k-tile)
#ifndef Q8K_ROW_TILE
#define Q8K_ROW_TILE 8
#endif

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
  std::vector<int16_t> sums32;  // per 32 values (a Q4_K sub-block; at most 32 * 127)

  Q8Rows(const float* x, int64_t n, int64_t k)
      : k(k), q(n * k), d(n * k / Q8_BLOCK), sums(n * k / 16), sums32(n * k / 32) {
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
    for (size_t j = 0; j < sums32.size(); j++) sums32[j] = static_cast<int16_t>(sums[2 * j] + sums[2 * j + 1]);
  }
  const int8_t* row_block(int64_t row, int64_t block) const { return q.data() + row * k + block * Q8_BLOCK; }
  float scale(int64_t row, int64_t block) const { return d[row * (k / Q8_BLOCK) + block]; }
  const int16_t* block_sums(int64_t row, int64_t block) const { return sums.data() + row * (k / 16) + block * 16; }
  const int16_t* block_sums32(int64_t row, int64_t block) const { return sums32.data() + row * (k / 32) + block * 8; }
};

// One activation row's sum over a weight row's blocks. With AVX-512 or AVX2 each block's integer lane sums are
// scaled into fp32 lanes, reduced once per weight row (no horizontal sum per block).
#if defined(__AVX512BW__)
struct Q8Accumulator {
  __m512 products = _mm512_setzero_ps();  // d dx (q . x) per lane
  __m256 offsets = _mm256_setzero_ps();   // the K-quants' mins (Q4_K) or offsets (Q6_K) per lane
  float total() const { return _mm512_reduce_add_ps(_mm512_add_ps(products, _mm512_zextps256_ps512(offsets))); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Q8Accumulator {
  __m256 products = _mm256_setzero_ps();
  __m256 offsets = _mm256_setzero_ps();
  float total() const { return hsum8(_mm256_add_ps(products, offsets)); }
};
#else
struct Q8Accumulator {
  float sum = 0.0f;
  float total() const { return sum; }
};
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
#elif defined(__AVX2__) && defined(__FMA__)
  // 64 values a chunk, unpacked once for the NR rows, each row's integer sum in a register of its own
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i sum[NR];
  for (int r = 0; r < NR; r++) sum[r] = _mm256_setzero_si256();
  for (int c = 0; c < 4; c++) {  // bytes: unsigned 4-bit weights times signed 8-bit activations, pairwise in int16
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    const __m256i low = _mm256_and_si256(packed, low4), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    const __m256i scale_low = _mm256_set1_epi16(sm[2 * c]), scale_high = _mm256_set1_epi16(sm[2 * c + 1]);
    for (int r = 0; r < NR; r++) {
      const int8_t* xq = x.row_block(row0 + r, block) + 64 * c;
      const __m256i a = _mm256_maddubs_epi16(low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
      const __m256i b = _mm256_maddubs_epi16(high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32)));
      sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(_mm256_madd_epi16(a, scale_low), _mm256_madd_epi16(b, scale_high)));
    }
  }
  alignas(32) int16_t mins_per_16[16];  // m_j for both halves of sub-block j, against the sums of 16 activations
  for (int j = 0; j < 16; j++) mins_per_16[j] = sm[8 + j / 2];
  const __m256i mins = _mm256_load_si256(reinterpret_cast<const __m256i*>(mins_per_16));
  for (int r = 0; r < NR; r++) {
    const __m256i min_terms =
        _mm256_madd_epi16(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.block_sums(row0 + r, block))));
    const float dx = x.scale(row0 + r, block);
    acc[r].products = _mm256_fmadd_ps(_mm256_set1_ps(dx * d), _mm256_cvtepi32_ps(sum[r]), acc[r].products);
    acc[r].offsets = _mm256_fmadd_ps(_mm256_set1_ps(-dx * dmin), _mm256_cvtepi32_ps(min_terms), acc[r].offsets);
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
#elif defined(__AVX2__) && defined(__FMA__)
  // 32 values a group, unpacked once for the NR rows, each row's integer sum in a register of its own
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  __m256i sum[NR];
  for (int r = 0; r < NR; r++) sum[r] = _mm256_setzero_si256();
  for (int half = 0; half < 2; half++) {
    const uint8_t* ql = w + 64 * half;
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * half));
    for (int m = 0; m < 4; m++) {  // elements 32m..32m+31 of the half: scales sc[8 half + 2m], sc[8 half + 2m + 1]
      const __m256i packed = m == 0 ? a : m == 1 ? c : m == 2 ? _mm256_srli_epi16(a, 4) : _mm256_srli_epi16(c, 4);
      const __m256i high = m == 0 ? _mm256_slli_epi16(h, 4) : m == 1 ? _mm256_slli_epi16(h, 2)
                         : m == 2 ? h : _mm256_srli_epi16(h, 2);
      const __m256i values = _mm256_or_si256(_mm256_and_si256(packed, low4), _mm256_and_si256(high, bits45));
      const __m256i scale =
          _mm256_set_m128i(_mm_set1_epi16(sc[8 * half + 2 * m + 1]), _mm_set1_epi16(sc[8 * half + 2 * m]));
      for (int r = 0; r < NR; r++) {
        const int8_t* xq = x.row_block(row0 + r, block) + 128 * half + 32 * m;
        const __m256i products = _mm256_maddubs_epi16(values, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(products, scale));
      }
    }
  }
  // sc_j against the sums of 16 activations
  const __m256i offsets16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
  for (int r = 0; r < NR; r++) {
    const __m256i offset_terms = _mm256_madd_epi16(
        offsets16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.block_sums(row0 + r, block))));
    const float dx_d = x.scale(row0 + r, block) * d;
    acc[r].products = _mm256_fmadd_ps(_mm256_set1_ps(dx_d), _mm256_cvtepi32_ps(sum[r]), acc[r].products);
    acc[r].offsets = _mm256_fmadd_ps(_mm256_set1_ps(-32.0f * dx_d), _mm256_cvtepi32_ps(offset_terms), acc[r].offsets);
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
// threads, Q8K_ROW_TILE rows of x per pass over a weight row's blocks (each block unpacked once for them).
template <int F>
void linear_q8k(const float* x, int64_t n, int64_t k, const uint8_t* weight, const float* bias, float* out,
                int64_t rows) {
  const Q8Rows q8(x, n, k);
  const int64_t blocks = k / Q8_BLOCK, row_bytes = blocks * Block<F>::bytes;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    Q8Accumulator acc[Q8K_ROW_TILE];
    for (int64_t r = begin; r < end; r++) {
      const uint8_t* row = weight + r * row_bytes;
      for (int64_t i = 0; i < n; i += Q8K_ROW_TILE) {
        const int nr = static_cast<int>(std::min<int64_t>(Q8K_ROW_TILE, n - i));
        std::fill(acc, acc + Q8K_ROW_TILE, Q8Accumulator{});
        with_count<Q8K_ROW_TILE>(nr, [&](auto tile) {
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

#ifdef SPECPLAN_Q4K_X8
// ---------------------------------------------------------------------------------------------------------------
// Q4_K with 8 weight rows interleaved (the layout llama.cpp's CPU backend repacks Q4_K into on AVX2, ggml-cpu
// repack.cpp, block_q4_Kx8): 4 bytes of each of 8 rows side by side, so one vpmaddubsw multiplies 8 rows' values by
// the same 4 broadcast activations and its int16 lanes stay per row. A sub-block's 8 products add up in int16
// (8 x 2 x 15 x 127 < 2^15) before one vpmaddwd applies the 8 rows' scales: per 32 values and 8 rows, 8 multiplies
// and one scaling instead of 8 multiplies and 8 scalings, and each row's float sum sits in a lane of its own (no
// horizontal sum). Every row count takes this path, so a row's result does not depend on how many rows a forward
// scores. Used on AVX2 and AVX-512 hosts alike, where it beats dot_q4k_block on one-row and batched passes
// (bench/kernel_variants.py q4k-x8; the log); dot_q4k_block serves matrices of rows not a multiple of 8.
//
// One group block (Q4K_X8_BLOCK_BYTES): 8 rows' block `b`:
//   d[8], dmin[8] (fp16) | scales[8 sub-blocks][8 rows] | mins[4 sub-block pairs][8 rows][2] | qs[4 chunks][8 groups
//   of 4 bytes][8 rows][4 bytes], chunk c holding values 64c..64c+31 (low nibbles) and 64c+32..64c+63 (high).
// Activation rows per pass over a group's blocks (their int16 sums and the unpacked weights fill the 16 ymm registers)
#ifndef X8_ACT_TILE
#define X8_ACT_TILE 4
#endif
// With AVX-512BW's byte and word arithmetic, a matmul of X8_ZMM_ROWS activation rows or more takes two groups a pass,
// side by side in zmm registers (llama.cpp's AVX-512 Q4_K gemm does the same): qwen2.5-coder-1.5b's Q4_K matrices at
// 16, 64 and 512 rows 1.2-1.5x faster than a group a pass; at 1-6 rows slower, level at 8 (bench/kernel_variants.py
// q4k-x8 Q4K_X8_ZMM=0 Q4K_X8_ZMM=1 rows=...; a 2-core Zen 4 EPYC). Q4K_X8_ZMM=0 keeps a group a pass.
#ifndef Q4K_X8_ZMM
#define Q4K_X8_ZMM 1
#endif
#if defined(__AVX512BW__) && Q4K_X8_ZMM
#define X8_GROUPS_PER_PASS 2
#else
#define X8_GROUPS_PER_PASS 1
#endif
#ifndef X8_ZMM_ROWS
#define X8_ZMM_ROWS 9
#endif
// Activation rows per pass over a pair of groups (6 beat 4 and 8 at 64 and 512 rows)
#ifndef X8_ZMM_ACT_TILE
#define X8_ZMM_ACT_TILE 6
#endif

template <int NC>
inline void dot_q4k_x8_block(const uint8_t* w, const Q8Rows& x, int64_t row0, int64_t block, __m256* acc) {
  const __m128i* header = reinterpret_cast<const __m128i*>(w);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(header)), dmin = _mm256_cvtph_ps(_mm_loadu_si128(header + 1));
  __m256i scale[8];  // int16 lanes 2r, 2r + 1: row r's scale of sub-block j
  for (int j = 0; j < 8; j++) {
    const __m128i s = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 32 + 8 * j));
    scale[j] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s, s));
  }
  const uint8_t* qs = w + 160;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int8_t* xq[NC];
  __m256i sum[NC];
  for (int a = 0; a < NC; a++) xq[a] = x.row_block(row0 + a, block), sum[a] = _mm256_setzero_si256();
  for (int c = 0; c < 4; c++) {
    __m256i low_sum[NC], high_sum[NC];  // int16 lanes 2r, 2r + 1: row r's pairwise products of sub-block 2c, 2c + 1
    for (int a = 0; a < NC; a++) low_sum[a] = high_sum[a] = _mm256_setzero_si256();
    for (int v = 0; v < 8; v++) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (8 * c + v)));
      const __m256i low = _mm256_and_si256(packed, low4), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      for (int a = 0; a < NC; a++) {
        int32_t x_low, x_high;
        std::memcpy(&x_low, xq[a] + 64 * c + 4 * v, 4);
        std::memcpy(&x_high, xq[a] + 64 * c + 32 + 4 * v, 4);
        low_sum[a] = _mm256_add_epi16(low_sum[a], _mm256_maddubs_epi16(low, _mm256_set1_epi32(x_low)));
        high_sum[a] = _mm256_add_epi16(high_sum[a], _mm256_maddubs_epi16(high, _mm256_set1_epi32(x_high)));
      }
    }
    for (int a = 0; a < NC; a++)
      sum[a] = _mm256_add_epi32(sum[a], _mm256_add_epi32(_mm256_madd_epi16(low_sum[a], scale[2 * c]),
                                                         _mm256_madd_epi16(high_sum[a], scale[2 * c + 1])));
  }
  __m256i mins[4];  // int16 lanes 2r, 2r + 1: row r's mins of sub-blocks 2p, 2p + 1
  for (int p = 0; p < 4; p++)
    mins[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 96 + 16 * p)));
  for (int a = 0; a < NC; a++) {
    const int16_t* sums = x.block_sums32(row0 + a, block);
    __m256i min_terms = _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) {
      int32_t pair;
      std::memcpy(&pair, sums + 2 * p, 4);
      min_terms = _mm256_add_epi32(min_terms, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(pair)));
    }
    const __m256 dx = _mm256_set1_ps(x.scale(row0 + a, block));
    acc[a] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sum[a]), acc[a]);
    acc[a] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(min_terms), acc[a]);
  }
}

template <int G>
struct X8Accumulator {
  using type = __m256;
};

template <int NC>
inline void dot_x8(const uint8_t* const* block, const Q8Rows& x, int64_t row0, int64_t b, __m256* acc) {
  dot_q4k_x8_block<NC>(block[0], x, row0, b, acc);
}

inline void store_x8(float* out, __m256 acc, const float* bias) {
  _mm256_storeu_ps(out, bias ? _mm256_add_ps(acc, _mm256_loadu_ps(bias)) : acc);
}

#ifdef __AVX512BW__
inline __m512i pair_256(const uint8_t* low, const uint8_t* high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)), 1);
}

inline __m256i pair_128(const uint8_t* low, const uint8_t* high) {
  return _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high)),
                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(low)));
}

// Two groups' block `b` side by side (group g in a zmm's low half, g + 1 in its high half), on AVX-512BW: the same
// integer sums and the same float operations per lane as dot_q4k_x8_block, so a row's result does not depend on
// whether its group was paired; half the instructions per product.
template <int NC>
inline void dot_q4k_x8_pair_block(const uint8_t* w0, const uint8_t* w1, const Q8Rows& x, int64_t row0,
                                  int64_t block, __m512* acc) {
  const __m512 d = _mm512_cvtph_ps(pair_128(w0, w1)), dmin = _mm512_cvtph_ps(pair_128(w0 + 16, w1 + 16));
  __m512i scale[8];  // int16 lanes 2r, 2r + 1 of each half: that group's row r's scale of sub-block j
  for (int j = 0; j < 8; j++) {
    const __m128i s = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w0 + 32 + 8 * j)),
                                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w1 + 32 + 8 * j)));
    scale[j] = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(s, s), _mm_unpacklo_epi8(s, s)));
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int8_t* xq[NC];
  __m512i sum[NC];
  for (int a = 0; a < NC; a++) xq[a] = x.row_block(row0 + a, block), sum[a] = _mm512_setzero_si512();
  for (int c = 0; c < 4; c++) {
    __m512i low_sum[NC], high_sum[NC];
    for (int a = 0; a < NC; a++) low_sum[a] = high_sum[a] = _mm512_setzero_si512();
    for (int v = 0; v < 8; v++) {
      const int64_t offset = 160 + 32 * (8 * c + v);
      const __m512i packed = pair_256(w0 + offset, w1 + offset);
      const __m512i low = _mm512_and_si512(packed, low4), high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      for (int a = 0; a < NC; a++) {
        int32_t x_low, x_high;
        std::memcpy(&x_low, xq[a] + 64 * c + 4 * v, 4);
        std::memcpy(&x_high, xq[a] + 64 * c + 32 + 4 * v, 4);
        low_sum[a] = _mm512_add_epi16(low_sum[a], _mm512_maddubs_epi16(low, _mm512_set1_epi32(x_low)));
        high_sum[a] = _mm512_add_epi16(high_sum[a], _mm512_maddubs_epi16(high, _mm512_set1_epi32(x_high)));
      }
    }
    for (int a = 0; a < NC; a++)
      sum[a] = _mm512_add_epi32(sum[a], _mm512_add_epi32(_mm512_madd_epi16(low_sum[a], scale[2 * c]),
                                                         _mm512_madd_epi16(high_sum[a], scale[2 * c + 1])));
  }
  __m512i mins[4];
  for (int p = 0; p < 4; p++) mins[p] = _mm512_cvtepu8_epi16(pair_128(w0 + 96 + 16 * p, w1 + 96 + 16 * p));
  for (int a = 0; a < NC; a++) {
    const int16_t* sums = x.block_sums32(row0 + a, block);
    __m512i min_terms = _mm512_setzero_si512();
    for (int p = 0; p < 4; p++) {
      int32_t pair;
      std::memcpy(&pair, sums + 2 * p, 4);
      min_terms = _mm512_add_epi32(min_terms, _mm512_madd_epi16(mins[p], _mm512_set1_epi32(pair)));
    }
    const __m512 dx = _mm512_set1_ps(x.scale(row0 + a, block));
    acc[a] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(sum[a]), acc[a]);
    acc[a] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(min_terms), acc[a]);
  }
}

template <>
struct X8Accumulator<2> {
  using type = __m512;
};

template <int NC>
inline void dot_x8(const uint8_t* const* block, const Q8Rows& x, int64_t row0, int64_t b, __m512* acc) {
  dot_q4k_x8_pair_block<NC>(block[0], block[1], x, row0, b, acc);
}

inline void store_x8(float* out, __m512 acc, const float* bias) {
  _mm512_storeu_ps(out, bias ? _mm512_add_ps(acc, _mm512_loadu_ps(bias)) : acc);
}
#endif

}  // namespace

void interleave_q4k(const uint8_t* data, int64_t rows, int64_t k, uint8_t* out) {
  const int64_t blocks = k / Q8_BLOCK, row_bytes = blocks * Block<Q4_K>::bytes;
  for (int64_t g = 0; g < rows / Q4K_X8_ROWS; g++)
    for (int64_t b = 0; b < blocks; b++) {
      uint8_t* o = out + (g * blocks + b) * Q4K_X8_BLOCK_BYTES;
      for (int r = 0; r < Q4K_X8_ROWS; r++) {
        const uint8_t* src = data + (g * Q4K_X8_ROWS + r) * row_bytes + b * Block<Q4_K>::bytes;
        uint8_t sm[16];
        scales_mins_k4(src + 4, sm);
        std::memcpy(o + 2 * r, src, 2);
        std::memcpy(o + 16 + 2 * r, src + 2, 2);
        for (int j = 0; j < 8; j++) o[32 + 8 * j + r] = sm[j];
        for (int p = 0; p < 4; p++) o[96 + 16 * p + 2 * r] = sm[8 + 2 * p], o[96 + 16 * p + 2 * r + 1] = sm[9 + 2 * p];
        for (int c = 0; c < 4; c++)
          for (int v = 0; v < 8; v++) std::memcpy(o + 160 + 32 * (8 * c + v) + 4 * r, src + 16 + 32 * c + 4 * v, 4);
      }
    }
}

// Every activation row against the interleaved groups g .. g + G - 1 (their rows in one accumulator register each).
template <int G>
void x8_groups(const Q8Rows& q8, int64_t n, int64_t blocks, const uint8_t* weight, const float* bias, float* out,
               int64_t rows, int64_t g) {
  const uint8_t* group[G];
  for (int h = 0; h < G; h++) group[h] = weight + (g + h) * blocks * Q4K_X8_BLOCK_BYTES;
  constexpr int tile_rows = G == 1 ? X8_ACT_TILE : X8_ZMM_ACT_TILE;
  for (int64_t i = 0; i < n; i += tile_rows) {
    with_count<tile_rows>(std::min<int64_t>(tile_rows, n - i), [&](auto tile) {
      constexpr int NC = decltype(tile)::value;
      typename X8Accumulator<G>::type acc[NC] = {};
      for (int64_t b = 0; b < blocks; b++) {
        const uint8_t* block[G];
        for (int h = 0; h < G; h++) {
          block[h] = group[h] + b * Q4K_X8_BLOCK_BYTES;
          for (int line = 0; line < Q4K_X8_BLOCK_BYTES; line += 64)
            __builtin_prefetch(block[h] + PREFETCH_BYTES + line);
        }
        dot_x8<NC>(block, q8, i, b, acc);
      }
      for (int a = 0; a < NC; a++)
        store_x8(out + (i + a) * rows + Q4K_X8_ROWS * g, acc[a], bias ? bias + Q4K_X8_ROWS * g : nullptr);
    });
  }
}

void linear_q4k_x8(const float* x, int64_t n, int64_t k, const uint8_t* weight, const float* bias, float* out,
                   int64_t rows) {
  const Q8Rows q8(x, n, k);
  const int64_t blocks = k / Q8_BLOCK, groups = rows / Q4K_X8_ROWS;
  const int64_t per_pass = n >= X8_ZMM_ROWS ? X8_GROUPS_PER_PASS : 1;
  at::parallel_for(0, (groups + per_pass - 1) / per_pass, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const int64_t g = per_pass * p;
      if (per_pass > 1 && g + per_pass <= groups)
        x8_groups<X8_GROUPS_PER_PASS>(q8, n, blocks, weight, bias, out, rows, g);
      else
        x8_groups<1>(q8, n, blocks, weight, bias, out, rows, g);  // a group a pass, or the last of an odd count
    }
  });
}

namespace {
#endif

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

}  // namespace

int64_t format_named(const std::string& name) {
  for (int64_t f = 0; f < FORMAT_COUNT; f++)
    if (name == FORMAT_NAMES[f]) return f;
  TORCH_CHECK(false, "unsupported weight format ", name);
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

bool direct_up_to_f32_rows(int64_t format) {
  return format == F32 || native_avx2(format);
}

void linear_direct(int64_t format, const float* x, int64_t n, int64_t k, const uint8_t* weight, int64_t row_bytes,
                   const float* bias, float* out_f, c10::BFloat16* out_h, int64_t rows) {
  if (format == Q4_K || format == Q6_K) {
    TORCH_CHECK(out_f, "linear: K-quant weights take fp32 activations");
    if (format == Q4_K) linear_q8k<Q4_K>(x, n, k, weight, bias, out_f, rows);
    else linear_q8k<Q6_K>(x, n, k, weight, bias, out_f, rows);
    return;
  }
  with_format(format, [&](auto f) {
    constexpr int F = decltype(f)::value;
    if constexpr (F != Q4_K && F != Q6_K) linear_rows<F>(x, n, k, weight, row_bytes, bias, out_f, out_h, rows);
  });
}

#ifdef __AVX512BF16__
void linear_bf16_native(const uint16_t* x, int64_t n, int64_t k, const uint16_t* weight, const float* bias,
                        float* out_f, c10::BFloat16* out_h, int64_t rows) {
  bf16_native_rows(x, n, k, weight, bias, out_f, out_h, rows);
}
#endif

void decode_rows(int64_t format, const uint8_t* weight, int64_t row_bytes, int64_t cols, const int64_t* ids, int64_t n,
                 float* out) {
  with_format(format, [&](auto f) {
    at::parallel_for(0, n, ids ? 1 : 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++)
        decode_row<decltype(f)::value>(weight + (ids ? ids[i] : i) * row_bytes, cols, out + i * cols);
    });
  });
}

void q5_0_as_q8_0(const uint8_t* data, int64_t blocks, uint8_t* out) {
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* src = data + b * Block<Q5_0>::bytes;
    uint8_t* o = out + b * Block<Q8_0>::bytes;
    uint32_t qh; std::memcpy(&qh, src + 2, 4);
    std::memcpy(o, src, 2);
    for (int j = 0; j < 16; j++) {  // element j in the low nibble of byte j, j + 16 in the high; bit j of qh its fifth
      const int low = (src[6 + j] & 15) | ((qh >> j) & 1) << 4, high = (src[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
      o[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(low - 16));
      o[18 + j] = static_cast<uint8_t>(static_cast<int8_t>(high - 16));
    }
  }
}

}  // namespace specplan_kernels
