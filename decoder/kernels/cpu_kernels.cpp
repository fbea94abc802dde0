// CPU kernels for the lean forward (decoder/model.py), built for the host they run on (decoder/cpu_kernels.py).
//
// A one-token forward of a small model on a CPU is a few weight passes and many tiny operators; PyTorch's eager
// operators cost microseconds each and oneDNN's one-row matmuls stream weights at about half the bandwidth.
// These kernels do each step of a layer in one call, on torch's own thread pool (at::parallel_for):
//   linear       x @ W^T + b for W in fp32, bf16 or a GGUF block format as the file ships it (Q4_0, Q4_1, Q5_0,
//                Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), each block decoded in registers as it streams: no dequantized copy;
//   rope_store   q/k (optionally RMS-normed per head) rotated, k and v written to the layer's cache slots;
//   attention    softmax(q k^T * scale + mask) v over the cache for few query rows, grouped KV heads, keys split
//                in fixed chunks across threads and merged (flash-decoding), each decoding row's bits its own;
//   rms_norm     with the residual add fused; gated_activation (SiLU or GELU-tanh gate times up); dequantize and
//                dequantize_rows (an embedding lookup in a block format).
// Arithmetic is fp32; bf16 tensors are widened on load and rounded (nearest-even) on store, where the eager
// forward rounds its output. Portable across AVX-512 and AVX2 hosts through GCC vector extensions (a 16-float
// vector is one zmm or two ymm); avx512_bf16 hosts take vdpbf16ps for bf16 weights.
// Two translation units, compiled in parallel: linear.cpp (the matmuls' kernels, linear.h) and this one (the
// other kernels, torch's GEMM for many rows, the Python bindings); simd.h holds the vector helpers both use.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "linear.h"
#include "simd.h"

namespace {

using namespace specplan_kernels;

// From this many activation rows a matmul of fp32, bf16 or (not K-quant) block weights runs as torch's own GEMM
// (MKL or oneDNN) over the weight in fp32 panels (linear_gemm), which runs prefill chunks several times faster than
// register tiles (bench/kernel_variants.py gemm); with AVX-512 the tiles were measured best for 8 to 64 rows. On a
// 2-core AVX2 EPYC the GEMM passes the tiles from 5 rows on, and the direct passes (4 rows each) of fp32, Q4_1 and
// Q8_0 up to 64 rows (TORCH_GEMM_ROWS_F32; bench/kernel_variants.py forward ... rows=16,24,32,48,64: smollm2's fp32
// forward of 24-48 rows 15-22% faster in direct passes than through the GEMM, level at 64; its Q4_1 forward of 24-64
// rows 1.2-2.3x faster, decoding no fp32 panels). On an Intel Xeon with AMX (its AMX tiles unused: the arithmetic is fp32),
// the GEMM passes the register tiles from about 25 rows (bench/kernel_variants.py forward
// TORCH_GEMM_ROWS=17 TORCH_GEMM_ROWS=25 TORCH_GEMM_ROWS=65 [dtype=gguf] rows=16,24,32,48,64: smollm2's forward of 32-64
// rows 1.1-1.5x faster in fp32, 1.1-1.4x in Q4_1; of 24 rows, the tiles 10% ahead in Q4_1).
#ifndef TORCH_GEMM_ROWS
#if defined(__AVX512F__) && defined(__AMX_TILE__)
#define TORCH_GEMM_ROWS 25
#elif defined(__AVX512F__)
#define TORCH_GEMM_ROWS 65
#else
#define TORCH_GEMM_ROWS 5
#endif
#endif
#ifndef TORCH_GEMM_ROWS_F32
#ifdef __AVX512F__
#define TORCH_GEMM_ROWS_F32 TORCH_GEMM_ROWS
#else
#define TORCH_GEMM_ROWS_F32 65
#endif
#endif
constexpr int64_t GEMM_PANEL_FLOATS = 1 << 22;  // a decoded panel of weight rows: 16 MB, whatever the matrix

// out = xf W^T + bias for many activation rows: the weight in fp32 panels of rows (F32 as it is, other formats
// decoded into a buffer, threads splitting the rows), each panel's product by torch's GEMM, written (and rounded to
// out's dtype) into its columns. Each value is the same fp32 dot product as the register tiles', summed in another
// order.
void linear_gemm(int64_t format, const torch::Tensor& xf, const uint8_t* weight, int64_t row_bytes,
                 const torch::Tensor& bias, torch::Tensor& out, int64_t rows) {
  const int64_t k = xf.size(1), panel = std::max<int64_t>(1, GEMM_PANEL_FLOATS / k);
  torch::Tensor decoded;
  if (format != F32) decoded = torch::empty({std::min(panel, rows), k}, torch::dtype(torch::kFloat32));
  for (int64_t r0 = 0; r0 < rows; r0 += panel) {
    const int64_t count = std::min(panel, rows - r0);
    torch::Tensor w;
    if (format == F32) {
      w = torch::from_blob(const_cast<uint8_t*>(weight + r0 * row_bytes), {count, k}, torch::dtype(torch::kFloat32));
    } else {
      decode_rows(format, weight + r0 * row_bytes, row_bytes, k, nullptr, count, decoded.data_ptr<float>());
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
#ifdef SPECPLAN_Q4K_X8
  if (format_name == Q4K_X8_NAME) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && rows % Q4K_X8_ROWS == 0 &&
                    x.size(1) % block_elems(Q4_K) == 0 &&
                    weight.numel() == rows / Q4K_X8_ROWS * (x.size(1) / block_elems(Q4_K)) * Q4K_X8_BLOCK_BYTES,
                "linear: the interleaved Q4_K weight does not match x");
    const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
    auto out = torch::empty({x.size(0), rows}, torch::dtype(torch::kFloat32));
    torch::Tensor bias_f;
    if (bias) bias_f = bias->to(torch::kFloat32).contiguous();
    if (x.size(0) > 0)
      linear_q4k_x8(xf.data_ptr<float>(), x.size(0), x.size(1), static_cast<const uint8_t*>(weight.data_ptr()),
                    bias ? bias_f.data_ptr<float>() : nullptr, out.data_ptr<float>(), rows);
    return out.to(x.scalar_type());
  }
#endif
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
  const int64_t gemm_rows = direct_up_to_f32_rows(format) ? TORCH_GEMM_ROWS_F32 : TORCH_GEMM_ROWS;
  if (n >= gemm_rows && format != Q4_K && format != Q6_K) linear_gemm(format, xf, w, row_bytes, bias_f, out, rows);
  else linear_direct(format, xf.data_ptr<float>(), n, k, w, row_bytes, b, out_f, out_h, rows);
  return out;
}

// A weight in `format` ([rows, row bytes] uint8) in the layout this build's matmuls read fastest, and that layout's
// name; nullopt where it is the file's own. Q4_K on AVX2 and AVX-512: 8 rows interleaved (linear.cpp). Q5_0: the
// Q8_0 blocks of the same values, 1.55x the bytes, whose products are bitwise the same and which decode without a
// fifth bit to gather per value: on a Zen 4 EPYC qwen2.5-coder-0.5b's Q5_0 layers run one-row passes 1.38x faster
// (AVX-512; 1.0x at 8 rows, 1-4% slower from 12), and 1.76x on the AVX2 build (1.1-1.6x at 2-64 rows)
// (bench/kernel_variants.py q5-0 haswell).
c10::optional<std::tuple<std::string, torch::Tensor>> repack(const std::string& format_name, torch::Tensor weight,
                                                             int64_t rows, int64_t cols) {
  const int64_t format = format_named(format_name);
  if (format == Q5_0 && weight.is_contiguous() && cols % block_elems(Q5_0) == 0) {
    const int64_t blocks = rows * (cols / block_elems(Q5_0));
    TORCH_CHECK(weight.numel() == blocks * block_bytes(Q5_0), "repack: the Q5_0 weight does not match its shape");
    auto out = torch::empty({rows, cols / block_elems(Q8_0) * block_bytes(Q8_0)}, torch::kUInt8);
    q5_0_as_q8_0(static_cast<const uint8_t*>(weight.data_ptr()), blocks, out.data_ptr<uint8_t>());
    return std::make_tuple(std::string("Q8_0"), out);
  }
#ifdef SPECPLAN_Q4K_X8
  if (format == Q4_K && rows % Q4K_X8_ROWS == 0 && weight.is_contiguous()) {
    auto out = torch::empty({rows / Q4K_X8_ROWS * (cols / block_elems(Q4_K)) * Q4K_X8_BLOCK_BYTES}, torch::kUInt8);
    interleave_q4k(static_cast<const uint8_t*>(weight.data_ptr()), rows, cols, out.data_ptr<uint8_t>());
    return std::make_tuple(std::string(Q4K_X8_NAME), out);
  }
#endif
  return c10::nullopt;
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
  decode_rows(format, w, row_bytes, cols, id, n, y);
  return out;
}

torch::Tensor dequantize(const std::string& format_name, torch::Tensor weight, int64_t rows, int64_t cols) {
  const int64_t format = format_named(format_name);
  const int64_t row_bytes = cols / block_elems(format) * block_bytes(format);
  TORCH_CHECK(weight.numel() * weight.element_size() == rows * row_bytes, "dequantize: weight size does not match");
  auto out = torch::empty({rows, cols}, torch::dtype(torch::kFloat32));
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  float* y = out.data_ptr<float>();
  decode_rows(format, w, row_bytes, cols, nullptr, rows, y);
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

// The attention's register-tiled fp32 paths on ymm registers (ATTENTION_YMM) run on every host with AVX2 and FMA:
// on an Intel Xeon with AVX-512 they beat the 16-float dot products per (row, key), which wait on each sum
// (bench/kernel_variants.py attention ATTENTION_YMM=0 ATTENTION_YMM=1: one row over 300-7,680 keys 1.1-1.5x faster;
// unmeasured on the AVX-512 EPYC).
#ifndef ATTENTION_YMM
#if defined(__AVX2__) && defined(__FMA__)
#define ATTENTION_YMM 1
#else
#define ATTENTION_YMM 0
#endif
#endif

#if ATTENTION_YMM
// AVX2 paths of the attention over an fp32 cache on native ymm registers (GCC's 16-float vectors compile to slow
// loops there, and 16 of them held at once spill): a head's scores for a few query rows, KT keys at a time, and
// the value accumulation, the probabilities broadcast over 16-float slices of each value row.
// {sum of a, sum of b, sum of c, sum of d}: four ymm registers' lane sums in one xmm
inline __m128 hsum8_four(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // per 128-bit half: a b c d partial sums
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// A decoding row's attention streams its cache's keys and values once, a core a task, faster when asked for this far
// ahead than the hardware prefetcher alone brings them (0: not asked; bench/kernel_variants.py attention-layers)
#ifndef ATTENTION_PREFETCH_BYTES
#define ATTENTION_PREFETCH_BYTES 2048
#endif
inline void prefetch_rows(const float* first, int64_t floats) {
  if constexpr (ATTENTION_PREFETCH_BYTES > 0) {
    const char* ahead = reinterpret_cast<const char*>(first) + ATTENTION_PREFETCH_BYTES;
    for (int64_t line = 0; line < floats * 4; line += 64) __builtin_prefetch(ahead + line);
  }
}

// scores[r * stride + (j - j0)] = (q_r . key_j) scale for R rows q [R, d] and keys j0..j1 of a [slots, d] block;
// d % 8 == 0.
// KT keys per pass share each query vector: R x KT accumulators + KT keys + 1 query of the 16 registers. Every
// score is the same sum, whatever R, KT or the key's place in the pass. Out of line: inlined into attention()'s task
// loop, GCC stored its accumulators to the stack at every step.
template <int R>
__attribute__((noinline)) void head_scores_avx2(const float* q, const float* keys, int64_t d, int64_t j0, int64_t j1,
                                                float scale, float* scores, int64_t stride) {
  constexpr int KT = R <= 2 ? 4 : 3;
  int64_t j = j0;
  for (; j + KT <= j1; j += KT) {
    prefetch_rows(keys + j * d, KT * d);
    __m256 acc[R][4];
    for (int r = 0; r < R; r++)
      for (int t = 0; t < 4; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e += 8) {
      __m256 key[KT];
      for (int t = 0; t < KT; t++) key[t] = _mm256_loadu_ps(keys + (j + t) * d + e);
      for (int r = 0; r < R; r++) {
        const __m256 qv = _mm256_loadu_ps(q + r * d + e);
        for (int t = 0; t < KT; t++) acc[r][t] = _mm256_fmadd_ps(qv, key[t], acc[r][t]);
      }
    }
    for (int r = 0; r < R; r++) {
      alignas(16) float sums[4];
      _mm_store_ps(sums, _mm_mul_ps(hsum8_four(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_ps(scale)));
      std::copy(sums, sums + KT, scores + r * stride + (j - j0));
    }
  }
  for (; j < j1; j++)
    for (int r = 0; r < R; r++) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t e = 0; e < d; e += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + e), _mm256_loadu_ps(keys + j * d + e), acc);
      scores[r * stride + (j - j0)] = _mm_cvtss_f32(hsum8_four(acc, acc, acc, acc)) * scale;  // as a grouped key's
    }
}

// acc[r] += sum_j p[r * stride + (j - j0)] value_j over values j0..j1 of a [slots, d] block for the 16-float slice
// from e of NR rows [NR, d], and with SUM sums[r] += sum_j p[...] key by key, in order (every lane the same sum). 2 NR
// accumulators, the slice's two value vectors, the broadcast weight (and the NR sums).
template <int NR, bool SUM, bool FIRST = SUM>
inline void accumulate_slice_avx2(const float* p, int64_t stride, const float* values, int64_t d, int64_t e,
                                  int64_t j0, int64_t j1, float* acc, __m256* sums) {
  __m256 lo[NR], hi[NR];
  for (int r = 0; r < NR; r++) {
    lo[r] = _mm256_loadu_ps(acc + r * d + e);
    hi[r] = _mm256_loadu_ps(acc + r * d + e + 8);
  }
  for (int64_t j = j0; j < j1; j++) {
    if constexpr (FIRST) prefetch_rows(values + j * d, d);  // the later slices find the rows in L2
    const __m256 v_lo = _mm256_loadu_ps(values + j * d + e), v_hi = _mm256_loadu_ps(values + j * d + e + 8);
    for (int r = 0; r < NR; r++) {
      const __m256 weight = _mm256_broadcast_ss(p + r * stride + (j - j0));
      lo[r] = _mm256_fmadd_ps(weight, v_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(weight, v_hi, hi[r]);
      if constexpr (SUM) sums[r] = _mm256_add_ps(sums[r], weight);
    }
  }
  for (int r = 0; r < NR; r++) {
    _mm256_storeu_ps(acc + r * d + e, lo[r]);
    _mm256_storeu_ps(acc + r * d + e + 8, hi[r]);
  }
}

// acc[r] += sum_j p[r * stride + (j - j0)] value_j for NR rows [NR, d] over values j0..j1 of a [slots, d] block,
// d % 16 == 0, and where `total` is given total[r] += sum_j p[...] key by key (riding along the first slice).
template <int NR>
void accumulate_values_avx2(const float* p, int64_t stride, const float* values, int64_t d, int64_t j0, int64_t j1,
                            float* acc, float* total) {
  __m256 sums[NR];
  for (int r = 0; r < NR; r++) sums[r] = _mm256_set1_ps(total ? total[r] : 0.0f);
  if (total) accumulate_slice_avx2<NR, true>(p, stride, values, d, 0, j0, j1, acc, sums);
  else accumulate_slice_avx2<NR, false, true>(p, stride, values, d, 0, j0, j1, acc, sums);
  for (int64_t e = 16; e < d; e += 16) accumulate_slice_avx2<NR, false>(p, stride, values, d, e, j0, j1, acc, sums);
  if (total)
    for (int r = 0; r < NR; r++) total[r] = _mm256_cvtss_f32(sums[r]);
}

#endif

// A sequence's new tokens below PROMPT_ROWS are decoding rows (a token, a draft tree, a chain). With `exact`,
// attention() gives each of them the bits it would have as the one new token of its sequence, its ancestors
// committed before it, whatever else the call holds (the other nodes of its tree, whose keys its mask hides, other
// sequences): every score one dot product per (row, key) in one order, the keys in fixed chunks (below), and so a
// tree verifies with the logits one-token decoding computes. decoder/model.py asks for it where the matmuls round
// their input to 8 bits (Q4_K, Q6_K), which turns a last-bit difference into logits hundredths apart, and then sends
// only prompts (from PROMPT_ROWS rows) to SDPA. Without it, a chunk of GEMM_ROWS / TILED_GEMM_ROWS query rows per KV
// head or more is scored by one matrix product (torch's GEMM, single-threaded inside the task): GEMM_ROWS where
// keys are read a row at a time (a bf16 cache, or no ymm paths), TILED_GEMM_ROWS where the register-tiled ymm paths
// score 3 rows a pass over an fp32 cache: faster than the GEMM up to 9 rows, level at 12, behind from 24
// (bench/kernel_variants.py attention-layers TILED_GEMM_ROWS=10 TILED_GEMM_ROWS=1000; docs/benchmark-log.md).
#ifndef PROMPT_ROWS
#define PROMPT_ROWS 65
#endif
#ifndef GEMM_ROWS
#define GEMM_ROWS 4
#endif
#ifndef TILED_GEMM_ROWS
#define TILED_GEMM_ROWS 10
#endif

// Without `exact`, a sequence of this many new tokens or more attends through PyTorch's SDPA (its CPU flash
// attention) rather than attention(), alone or beside others (decoder/model.py reads it as the module's sdpa_rows).
// On a 2-core AVX2 EPYC attention() is ahead for 2-3 rows (8-22% of a forward over 256-7,680 keys, alone or 2-4
// sequences a step) and SDPA from 4 (level at 4 rows over 256 keys, up to 1.35x faster for 8-11 rows over 7,680).
// On AVX-512 hosts (an AMD EPYC and an Intel Xeon with AMX) attention() is ahead up to 16 rows, most over long
// caches, and SDPA from 32 (bench/kernel_variants.py forward SDPA_ROWS=2 SDPA_ROWS=17 rows=2,4,8,16,32 context=7680;
// docs/benchmark-log.md).
#ifndef SDPA_ROWS
#if defined(__AVX512F__)
#define SDPA_ROWS 17
#else
#define SDPA_ROWS 4
#endif
#endif

// The tiled paths take this many keys (and then their values) at a time through every group of rows in turn, so
// that a task's later groups find them in the L2 rather than in memory.
#ifndef L2_KEYS
#define L2_KEYS 512
#endif

// Keys per chunk, below which a split costs more (a merge) than it spreads; a task takes a run of a head's chunks.
// With `exact` each chunk keeps a state of its own, and a decoding row's keys are summed in chunks of this many of
// the keys it sees, counted from the first: the slots' chunks below the last boundary at or before the sequence's
// first new key, then the rest (its tail) split where the row's own count of keys reaches the next boundary, which
// only a tree spanning that boundary does. Without it a task's run is one state.
#ifndef ATTENTION_CHUNK
#define ATTENTION_CHUNK 256
#endif
constexpr int64_t MAX_SCORES = 1 << 20;  // a task's scores buffer: 4 MB

// One sequence's share of a ragged attention call: its rows, keys, mask and where its tasks and running state sit.
struct AttentionPart {
  int64_t rows = 0;            // group * n_b: per KV head, row g * n_b + i is head kv * group + g, query i
  int64_t length = 0;          // keys
  bool decoding = false;       // fewer than PROMPT_ROWS new tokens
  int64_t tail = 0;            // decoding: the keys from here are the last chunk, the tail (a prompt: length)
  int64_t chunks = 0;          // per KV head: the slots' chunks below `tail`, then the tail
  int64_t group = 0;           // chunks per task (its keys, then its values, streamed in one pass)
  int64_t tasks = 0;           // per KV head: chunks / group, rounded up
  int64_t states = 0;          // running states per KV head and row: a chunk's, or one of the tail's two parts
  int64_t first_task = 0;      // its tasks: kv_heads * tasks from here
  int64_t first_state = 0;     // its running max/sum entries: kv_heads * states * rows from here
  const float* q = nullptr;    // [heads, n_b, d] in fp32
  const float* mask = nullptr; // additive, or null: every key visible
  int64_t mask_row = 0, mask_head = 0;  // the mask's row stride, and KV head kv's offset (0 where heads share one)

  // its task `local` (of KV head local / tasks) takes chunks chunk_begin(local) to chunk_stop(local), exclusive
  int64_t chunk_begin(int64_t local) const { return (local % tasks) * group; }
  int64_t chunk_stop(int64_t local) const { return std::min(chunks, chunk_begin(local) + group); }
  // chunk c holds keys c * ATTENTION_CHUNK on, to the next chunk's start or the last key
  int64_t chunk_end(int64_t c) const { return c + 1 == chunks ? length : (c + 1) * ATTENTION_CHUNK; }
};

// p = e^(s - top) over each row's keys j0..j1 (their scores [rows, stride] in `scores`, -inf after the last key up to
// a whole 16-key vector, replaced by p; a hidden key's -inf gives an exact 0, wherever it sits), then the row's sums
// of p and of p v into its state: with `exact`, key by key in order (an exact 0 anywhere leaves them as they were),
// else p's in 16-key vectors.
void settle_chunk(float* scores, int64_t stride, int64_t rows, int64_t j0, int64_t j1, const torch::Tensor& v_cache,
                  int64_t kv, int64_t d, bool cache_bf16, bool native, bool exact, float* run_max, float* run_sum,
                  float* acc_out, float* value_block) {
  const int64_t span = j1 - j0;
  constexpr float none = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; r++) {
    float* row = scores + r * stride;
    v16f tops = splat(none);
    for (int64_t j = 0; j < span; j += 16) tops = load(row + j) > tops ? load(row + j) : tops;
    float top = none;
    for (int i = 0; i < 16; i++) top = std::max(top, tops[i]);
    run_max[r] = top;
    run_sum[r] = 0.0f;
    if (top == none) {
      std::fill(row, row + span, 0.0f);
      continue;
    }
    v16f sums = {};
    for (int64_t j = 0; j < span; j += 16) {  // whole vectors only: a key's p is the same in any of them
      const v16f p = vexp(load(row + j) - top);
      store(row + j, p);
      sums += p;
    }
    if (!exact) run_sum[r] = hsum(sums);
  }
  std::fill(acc_out, acc_out + rows * d, 0.0f);
#if ATTENTION_YMM
  if (native) {
    const float* head_values = v_cache.data_ptr<float>() + kv * v_cache.stride(0);
    for (int64_t jb = j0; jb < j1; jb += L2_KEYS) {
      const int64_t je = std::min(j1, jb + L2_KEYS);
      for (int64_t r0 = 0; r0 < rows; r0 += 4)
        with_count<4>(std::min<int64_t>(4, rows - r0), [&](auto r) {
          accumulate_values_avx2<decltype(r)::value>(scores + r0 * stride + (jb - j0), stride, head_values, d, jb,
                                                     je, acc_out + r0 * d, exact ? run_sum + r0 : nullptr);
        });
    }
    return;
  }
#endif
  // acc_r += sum_j p_rj v_j and sum_r += p_rj, 16 keys at a time: each accumulator slice is loaded and stored once
  // per block
  for (int64_t jb = j0; jb < j1; jb += 16) {
    const int64_t count = std::min<int64_t>(16, j1 - jb);
    for (int64_t j = 0; j < count; j++) {
      const float* vj = cache_row(v_cache, kv, jb + j, d, cache_bf16, value_block + j * d);
      if (vj != value_block + j * d) std::copy(vj, vj + d, value_block + j * d);
    }
    for (int64_t r = 0; exact && r < rows; r++) {
      const float* p = scores + r * stride + (jb - j0);
      for (int64_t j = 0; j < count; j++) run_sum[r] += p[j];
    }
    int64_t e = 0;
    for (; e + 16 <= d; e += 16) {  // one 16-wide slice of the 16 values in registers, every row over it
      v16f slice[16];
      for (int64_t j = 0; j < count; j++) slice[j] = load(value_block + j * d + e);
      for (int64_t r = 0; r < rows; r++) {
        const float* p = scores + r * stride + (jb - j0);
        v16f a = load(acc_out + r * d + e);
        for (int64_t j = 0; j < count; j++) a += p[j] * slice[j];
        store(acc_out + r * d + e, a);
      }
    }
    for (; e < d; e++)
      for (int64_t r = 0; r < rows; r++) {
        const float* p = scores + r * stride + (jb - j0);
        for (int64_t j = 0; j < count; j++) acc_out[r * d + e] += p[j] * value_block[j * d + e];
      }
  }
}

// softmax(softcap(q k^T * scale) + mask) v for each of several sequences over its own keys: q [n * heads, d] as
// rope_store returns it (sequence b's block [heads, n_b, d], n_b = counts[b]) over the first lengths[b] slots of
// k_caches[b]/v_caches[b] [kv_heads, slots, d] (heads share a KV head in groups, as GQA), its new keys the last n_b;
// masks[b] additive, [n_b, >= length] or one per KV head [kv_heads, n_b, >= length], or an empty tensor (every key
// visible); softcap(s) = cap tanh(s / cap) where cap > 0 (Gemma 2), else s; `exact`: each decoding row's bits its
// own (above). Each (sequence, KV head, run of chunks of keys) is a task holding each chunk's running max, sum and
// weighted values for its rows; a head's chunks are merged at the end, in order.
// Returns [n, heads * d] in q's dtype, the sequences' rows one after another.
torch::Tensor attention(torch::Tensor q, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                        std::vector<int64_t> counts, std::vector<int64_t> lengths, std::vector<torch::Tensor> masks,
                        double scale, double softcap, bool exact) {
  const int64_t d = q.size(1), kv_heads = k_caches.empty() ? 1 : k_caches[0].size(0);
  const RaggedRows ragged(counts);
  const int64_t n = ragged.total(), sequences = static_cast<int64_t>(counts.size());
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.size(0) % std::max<int64_t>(n, 1) == 0, "attention: q layout");
  const int64_t heads = n > 0 ? q.size(0) / n : 0, group = heads / kv_heads;
  check_caches(k_caches, v_caches, counts, k_caches[0].scalar_type(), d, "attention");
  TORCH_CHECK(lengths.size() == counts.size() && masks.size() == counts.size(), "attention: one length and mask each");
  const bool cache_bf16 = k_caches[0].scalar_type() == torch::kBFloat16;
#if ATTENTION_YMM
  const bool native = !cache_bf16 && d % 16 == 0;
#else
  const bool native = false;
#endif
  const auto qf = q.to(torch::kFloat32).contiguous();
  std::vector<torch::Tensor> float_masks(sequences);
  std::vector<AttentionPart> parts(sequences);
  // a head's chunks spread over the threads in a few tasks of consecutive chunks (a task's keys and values stream
  // in long runs), at most MAX_SCORES scores a task; a batch spreads over its sequences before it splits their keys
  const int64_t threads = at::get_num_threads();
  const int64_t per_head = std::max<int64_t>(1, (2 * threads + kv_heads * sequences - 1) / (kv_heads * sequences));
  int64_t tasks = 0, states = 0;
  for (int64_t b = 0; b < sequences; b++) {
    AttentionPart& part = parts[b];
    part.rows = group * counts[b];
    part.length = lengths[b];
    TORCH_CHECK(part.length >= counts[b] && part.length <= k_caches[b].size(1), "attention: length beyond the cache");
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
    part.decoding = counts[b] < PROMPT_ROWS;
    if (part.decoding) {
      part.tail = (part.length - counts[b]) / ATTENTION_CHUNK * ATTENTION_CHUNK;
      part.chunks = part.tail / ATTENTION_CHUNK + (part.length > part.tail ? 1 : 0);
      part.states = part.chunks + 1;
    } else {
      part.tail = part.length;
      part.chunks = part.states = (part.length + ATTENTION_CHUNK - 1) / ATTENTION_CHUNK;
    }
    const int64_t widest = std::max<int64_t>(1, MAX_SCORES / (std::max<int64_t>(part.rows, 1) * ATTENTION_CHUNK));
    part.group = std::min(widest, std::max<int64_t>(1, (part.chunks + per_head - 1) / per_head));
    part.tasks = (part.chunks + part.group - 1) / part.group;
    part.first_task = tasks;
    part.first_state = states;
    tasks += kv_heads * part.tasks;
    states += kv_heads * part.states * part.rows;
  }
  std::vector<int64_t> task_part(tasks);
  for (int64_t b = 0; b < sequences; b++)
    std::fill(task_part.begin() + parts[b].first_task,
              task_part.begin() + parts[b].first_task + kv_heads * parts[b].tasks, b);
  constexpr float none = -std::numeric_limits<float>::infinity();
  std::vector<float> run_max(states, none), run_sum(states), run_acc(states * d);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // The tasks, costliest first (rows times keys), go to whichever thread is free: in a ragged batch (a few sequences
  // scoring a tree of several rows, the rest one) the threads' contiguous shares of the task list would hold unequal
  // work. Each task writes only its own states, so the order it runs in leaves every result's bits as they were.
  std::vector<int64_t> order(tasks), cost(tasks);
  for (int64_t task = 0; task < tasks; task++) {
    const AttentionPart& part = parts[task_part[task]];
    const int64_t local = task - part.first_task;
    cost[task] = part.rows * (part.chunk_end(part.chunk_stop(local) - 1) - part.chunk_begin(local) * ATTENTION_CHUNK);
  }
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min(threads, tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, second, key(d), value_block(16 * d);
    for (int64_t next = next_task++; next < tasks; next = next_task++) {
      const int64_t task = order[next];
      const int64_t b = task_part[task];
      const AttentionPart& part = parts[b];
      const torch::Tensor &k_cache = k_caches[b], &v_cache = v_caches[b];
      const int64_t local = task - part.first_task, rows = part.rows, n_b = counts[b];
      const int64_t kv = local / part.tasks, c0 = part.chunk_begin(local), c1 = part.chunk_stop(local);
      const int64_t j0 = c0 * ATTENTION_CHUNK, j1 = part.chunk_end(c1 - 1), span = j1 - j0, stride = (span + 15) / 16 * 16;
      if (static_cast<int64_t>(scores.size()) < rows * stride) scores.resize(rows * stride);
      const float* qh = part.q + kv * rows * d;
      const float* head_mask = part.mask ? part.mask + kv * part.mask_head : nullptr;
      const bool alone = part.decoding && (exact || rows < (native ? TILED_GEMM_ROWS : GEMM_ROWS));
      if (native && alone) {
#if ATTENTION_YMM
        const float* head_keys = k_cache.data_ptr<float>() + kv * k_cache.stride(0);
        for (int64_t jb = j0; jb < j1; jb += L2_KEYS) {
          const int64_t je = std::min(j1, jb + L2_KEYS);
          for (int64_t r0 = 0; r0 < rows; r0 += 3)
            with_count<3>(std::min<int64_t>(3, rows - r0), [&](auto r) {
              head_scores_avx2<decltype(r)::value>(qh + r0 * d, head_keys, d, jb, je, fscale,
                                                   scores.data() + r0 * stride + (jb - j0), stride);
            });
        }
#endif
        for (int64_t r = 0; (cap > 0.0f || head_mask) && r < rows; r++) {  // the scores come scaled
          float* out = scores.data() + r * stride;
          const float* row_mask = head_mask ? head_mask + (r % n_b) * part.mask_row + j0 : nullptr;
          for (int64_t j = 0; j < span; j++) {
            float score = out[j];
            if (cap > 0.0f) score = cap * std::tanh(score / cap);
            out[j] = row_mask ? score + row_mask[j] : score;
          }
        }
      } else if (alone) {
        for (int64_t j = j0; j < j1; j++) {
          const float* kj = cache_row(k_cache, kv, j, d, cache_bf16, key.data());
          for (int64_t r = 0; r < rows; r++) {
            float score = dot_row(qh + r * d, kj, d) * fscale;
            if (cap > 0.0f) score = cap * std::tanh(score / cap);
            if (head_mask) score += head_mask[(r % n_b) * part.mask_row + j];
            scores[r * stride + (j - j0)] = score;
          }
        }
      } else {  // q [rows, d] times the keys [span, d]^T in fp32 (a bf16 cache's keys widened first)
        const torch::Tensor q_rows = torch::from_blob(const_cast<float*>(qh), {rows, d}, torch::kFloat32);
        const torch::Tensor products =
            at::linear(q_rows, k_cache[kv].narrow(0, j0, span).to(torch::kFloat32)).contiguous();
        const float* product = products.data_ptr<float>();
        for (int64_t r = 0; r < rows; r++) {
          const float* row_mask = head_mask ? head_mask + (r % n_b) * part.mask_row + j0 : nullptr;
          float* out = scores.data() + r * stride;
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
      for (int64_t r = 0; r < rows; r++)  // whole 16-key vectors, the last one's missing keys hidden
        std::fill(scores.data() + r * stride + span, scores.data() + (r + 1) * stride, none);
      if (!exact) {  // the task's keys one state (its first chunk's), as long a run as the threads allow
        const int64_t state = part.first_state + (kv * part.states + c0) * rows;
        settle_chunk(scores.data(), stride, rows, j0, j1, v_cache, kv, d, cache_bf16, native, false,
                     run_max.data() + state, run_sum.data() + state, run_acc.data() + state * d, value_block.data());
        continue;
      }
      for (int64_t c = c0; c < c1; c++) {
        const int64_t cj0 = c * ATTENTION_CHUNK, cj1 = part.chunk_end(c), cspan = cj1 - cj0;
        float* chunk_scores = scores.data() + (cj0 - j0);
        // a tree spanning a boundary: each row's keys past the ATTENTION_CHUNK-th it sees in the tail go to a
        // second part, as one-token decoding's chunks would hold them
        bool split = false;
        const int64_t second_stride = (cspan + 15) / 16 * 16;
        if (part.decoding && c + 1 == part.chunks) {
          for (int64_t r = 0; r < rows; r++) {
            float* row = chunk_scores + r * stride;
            int64_t seen = 0, j = 0;
            for (; j < cspan && seen < ATTENTION_CHUNK; j++) seen += row[j] != none;
            if (j == cspan) continue;
            if (!split) second.assign(rows * second_stride, none);
            split = true;
            std::copy(row + j, row + cspan, second.data() + r * second_stride + j);
            std::fill(row + j, row + cspan, none);
          }
        }
        const int64_t state = part.first_state + (kv * part.states + c) * rows;
        settle_chunk(chunk_scores, stride, rows, cj0, cj1, v_cache, kv, d, cache_bf16, native, true,
                     run_max.data() + state, run_sum.data() + state, run_acc.data() + state * d, value_block.data());
        if (split)
          settle_chunk(second.data(), second_stride, rows, cj0, cj1, v_cache, kv, d, cache_bf16, native, true,
                       run_max.data() + state + rows, run_sum.data() + state + rows,
                       run_acc.data() + (state + rows) * d, value_block.data());
      }
    }
  });
  auto out = torch::empty({n, heads * d}, q.options());
  const bool out_bf16 = q.scalar_type() == torch::kBFloat16;
  // every (query row, head): row t's heads in order; the merge reads each of its states in order
  at::parallel_for(0, n * heads, 64, [&](int64_t begin, int64_t end) {  // a few rows: no fork
    std::vector<float> merged(d);
    for (int64_t th = begin; th < end; th++) {
      const int64_t t = th / heads, head = th % heads, b = ragged.sequence[t], i = ragged.offset[t];
      const AttentionPart& part = parts[b];
      const int64_t kv = head / group, r = (head % group) * counts[b] + i;
      float top = none;
      for (int64_t c = 0; c < part.states; c++)
        top = std::max(top, run_max[part.first_state + (kv * part.states + c) * part.rows + r]);
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t c = 0; c < part.states; c++) {
        const int64_t state = part.first_state + (kv * part.states + c) * part.rows + r;
        const float part_max = run_max[state];
        if (part_max == none) continue;
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
  m.attr("prompt_rows") = PROMPT_ROWS;
  m.attr("sdpa_rows") = SDPA_ROWS;
  m.def("formats", [] { return std::vector<std::string>(FORMAT_NAMES, FORMAT_NAMES + FORMAT_COUNT); });
  m.def("linear", &linear);
  m.def("repack", &repack);
  m.def("dequantize", &dequantize);
  m.def("dequantize_rows", &dequantize_rows);
  m.def("rms_norm", &rms_norm);
  m.def("gated_activation", &gated_activation);
  m.def("rope_store", &rope_store);
  m.def("attention", &attention);
}
