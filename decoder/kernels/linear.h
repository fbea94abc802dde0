// The matmul kernels (linear.cpp): x @ W^T + b for W in fp32, bf16 or a GGUF block format as the file ships it,
// each block decoded in registers as it streams, on torch's thread pool; and block rows decoded to fp32.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <string>

namespace specplan_kernels {

// Weight formats, named as GGML names its types (Python passes the name; GGML's numeric ids stay in gguf-py's
// GGMLQuantizationType), and for each block format its decoding into floats, written after ggml's
// dequantize_row_* (ggml-quants.c) so that a block means exactly what llama.cpp reads from the same file.

enum Format : int64_t { F32, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, FORMAT_COUNT };
inline constexpr const char* FORMAT_NAMES[FORMAT_COUNT] = {"F32", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K",
                                                "Q5_K", "Q6_K"};

int64_t format_named(const std::string& name);
int64_t block_elems(int64_t format);  // elements per block
int64_t block_bytes(int64_t format);
bool direct_up_to_f32_rows(int64_t format);  // its rows run linear_direct up to fp32's limit (before torch's GEMM)

// out[i, r] = x[i] . W[r] + bias[r] (bias may be null) for x [n, k] in fp32 and W [rows] rows of row_bytes bytes in
// `format`, into out_f (fp32) or out_h (bf16) [n, rows], by the kernels' own passes over the weight: for few rows
// (many rows of a format other than Q4_K/Q6_K are faster through torch's GEMM over decoded panels).
void linear_direct(int64_t format, const float* x, int64_t n, int64_t k, const uint8_t* weight, int64_t row_bytes,
                   const float* bias, float* out_f, c10::BFloat16* out_h, int64_t rows);

#ifdef __AVX512BF16__
// bf16 weights and activations on a CPU with avx512_bf16 (vdpbf16ps).
void linear_bf16_native(const uint16_t* x, int64_t n, int64_t k, const uint16_t* weight, const float* bias,
                        float* out_f, c10::BFloat16* out_h, int64_t rows);
#endif

// Q4_K weights with 8 rows interleaved (linear.cpp), on AVX2 and AVX-512 hosts
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECPLAN_Q4K_X8 1
inline constexpr int64_t Q4K_X8_ROWS = 8;
inline constexpr int64_t Q4K_X8_BLOCK_BYTES = 160 + Q4K_X8_ROWS * 128;  // 8 rows' 256 values (linear.cpp)
inline constexpr const char* Q4K_X8_NAME = "Q4_Kx8";
// `rows` (a multiple of 8) rows of k values in Q4_K blocks, into `out` (as many bytes) in the interleaved layout.
void interleave_q4k(const uint8_t* data, int64_t rows, int64_t k, uint8_t* out);
// linear_direct's out_f for W in the interleaved layout.
void linear_q4k_x8(const float* x, int64_t n, int64_t k, const uint8_t* weight, const float* bias, float* out,
                   int64_t rows);
#endif

// `blocks` Q5_0 blocks rewritten as the Q8_0 blocks of the same values: d kept, each q - 16 as an int8 (exact).
void q5_0_as_q8_0(const uint8_t* data, int64_t blocks, uint8_t* out);

// out[i] = row ids[i] of W (row i where ids is null), decoded to fp32 [n, cols].
void decode_rows(int64_t format, const uint8_t* weight, int64_t row_bytes, int64_t cols, const int64_t* ids, int64_t n,
                 float* out);

}  // namespace specplan_kernels
