// Shared by the CPU kernels' translation units (kernels/cpu_kernels.py builds them into one
// extension): the includes, bfloat16 rounding helpers, AVX-512 loads, and every operator's
// declaration (bindings.cpp registers them with torch and pybind11).
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

using bf16 = c10::BFloat16;
static inline float tof(float x) { return x; }
static inline float tof(bf16 x) { return static_cast<float>(x); }
template <typename T> static inline T fromf(float x);
template <> inline float fromf<float>(float x) { return x; }
template <> inline bf16 fromf<bf16>(float x) { return bf16(x); }  // round to nearest even, as torch
// One elementwise op of torch in dtype T: computed in float, rounded to T.
template <typename T> static inline float rnd(float x) { return tof(fromf<T>(x)); }

#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// attention.cpp
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                               torch::Tensor req_to_token, torch::Tensor rows,
                               torch::Tensor seq_lens, double scale);
torch::Tensor decode_attention_rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                    torch::Tensor positions, torch::Tensor k_buf, torch::Tensor v_buf,
                                    torch::Tensor out_loc, torch::Tensor req_to_token, torch::Tensor rows,
                                    torch::Tensor seq_lens, int64_t num_heads, double scale);

// rowwise.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
void argmax_rows(torch::Tensor logits, torch::Tensor ids, torch::Tensor void_ids);
void masked_argmax_rows(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor ids, torch::Tensor void_ids);
double stream_sum(torch::Tensor x);

// gemm.cpp
bool gemm_available();
torch::Tensor gemm_pack(torch::Tensor w);
torch::Tensor gemm(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t N);
bool gemm_bf16_available();
torch::Tensor gemm_pack_bf16(torch::Tensor w);
torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t N);
torch::Tensor onednn_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n);

// qgemm.cpp
torch::Tensor qgemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, c10::optional<torch::Tensor> biases,
                    int64_t bits, int64_t group_size, int64_t n);
