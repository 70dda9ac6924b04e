"""Hand-written CPU kernels, one C++ extension built on first use.

- Paged decode attention (`decode_attention`): reads K/V in place through req_to_token. The torch
  path gathers every sequence's K and V into a padded tensor before SDPA, which on a CPU costs
  more than the whole rest of a decode step at long contexts. This kernel reads each K/V row
  once, where it lies in the pool, with a two-pass softmax per (request, kv head) that serves
  every query head of the GQA group. `decode_attention_rope` also applies RoPE to q and k and
  stores k and v in the pool first: one call per layer instead of six.
- Linear layers for x86 CPUs with AVX-512 (`Gemm`): weights repacked once into 16-column panels,
  a register-blocked FMA kernel, and each output summed over k in order whatever the batch size
  (padding a batch never changes a row's result).
- RMSNorm with the residual add fused in (`add_rms_norm`), greedy argmax with the finiteness
  check (`argmax_rows`), and a streaming read of a buffer with every thread (`stream_sum`, for
  the memory-bandwidth figure of the benchmark).

Every kernel is also a torch operator (`torch.ops.radixray.*`, with fake implementations), so a
`torch.compile`d graph calls it as one opaque node. Numerics follow torch's: elementwise steps
round as torch's separate ops do (the build disables FMA contraction; the GEMM uses explicit
FMAs), bfloat16 results are rounded where torch rounds them.

Built with torch.utils.cpp_extension (g++ and ninja needed); `load()` returns None when that is
not possible and callers fall back to torch. Set RADIXRAY_CPU_KERNELS=0 to disable it."""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import time

import torch

from kernels.cache import cache_dir

_SOURCE = r"""
#include <torch/extension.h>
#include <torch/library.h>
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

// exp(x) for the softmax, where x <= 0: Cody-Waite reduction by ln 2 and the Cephes polynomial,
// written so that GCC vectorizes the loop around it (std::exp stays a scalar call, which cost
// more than the rest of the attention at batch 32). Within a few ulp of std::exp; NaN stays NaN.
static inline float exp_le0(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  return p * __builtin_bit_cast(float, e << 23);
}

// ------------------------------------------------------------------------------------------
// Decode attention.
// One work item: request b, kv heads [h0, h1). Every K/V row is read once, contiguously for
// the item's heads, and serves all G query heads of each kv head (GQA). q and o are float rows
// of all H heads (only the item's are touched). DT > 0: head_dim known at compile time.
template <int64_t DT, typename T>
static void attend(const float* qb, const T* kp, const T* vp, float* ob, const int32_t* slots,
                   int64_t L, int64_t Hkv, int64_t G, int64_t h0, int64_t h1, float sc,
                   std::vector<float>& scores, int64_t Drt) {
  const int64_t D = DT > 0 ? DT : Drt;
  const int64_t nh = (h1 - h0) * G;  // query heads of this item
  scores.resize(nh * L);
  for (int64_t t = 0; t < L; ++t) {
    const T* krow = kp + static_cast<int64_t>(slots[t]) * Hkv * D;
    for (int64_t hk = h0; hk < h1; ++hk) {
      const T* k = krow + hk * D;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        const float* q = qb + h * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += q[d] * tof(k[d]);
        scores[(h - h0 * G) * L + t] = s * sc;
      }
    }
  }
  for (int64_t j = 0; j < nh; ++j) {
    float* row = scores.data() + j * L;
    float mx = -FLT_MAX, sum = 0.f;
    for (int64_t t = 0; t < L; ++t) mx = std::max(mx, row[t]);
    for (int64_t t = 0; t < L; ++t) row[t] = exp_le0(row[t] - mx);
    for (int64_t t = 0; t < L; ++t) sum += row[t];
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) row[t] *= inv;
  }
  for (int64_t h = h0 * G; h < h1 * G; ++h) std::fill(ob + h * D, ob + (h + 1) * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const T* vrow = vp + static_cast<int64_t>(slots[t]) * Hkv * D;
    for (int64_t hk = h0; hk < h1; ++hk) {
      const T* v = vrow + hk * D;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        const float p = scores[(h - h0 * G) * L + t];
        float* o = ob + h * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p * tof(v[d]);
      }
    }
  }
}

#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The 16 lane-sums of a[0..15], as one vector (lane j = sum of a[j]): a transpose-and-add tree,
// 15 adds for 16 dot products instead of a horizontal reduction each.
static inline __m512 sum16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[i]'s halves summed; lanes 8-15: a[i + 8]'s
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44), _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // e holds the sums in a permuted lane order; put lane j's sum at j.
  const __m512i order = _mm512_set_epi32(15, 13, 14, 12, 7, 5, 6, 4, 11, 9, 10, 8, 3, 1, 2, 0);
  return _mm512_permutexvar_ps(order, e);
}

// attend<> for head_dim D = 16 * DV (D in {64, 128}): per kv head, the scores of 16 tokens at a
// time for each query head (one sum16 per 16 dot products), the softmax, then the values summed
// into registers holding up to 4 query heads' outputs while the V rows stream by once per group.
template <int DV, typename T>
static void attend_vec(const float* qb, const T* kp, const T* vp, float* ob, const int32_t* slots, int64_t L,
                       int64_t Hkv, int64_t G, int64_t h0, int64_t h1, float sc, std::vector<float>& scores) {
  constexpr int64_t D = 16 * DV;
  const int64_t nh = (h1 - h0) * G;
  const int64_t Lp = (L + 15) & ~int64_t(15);
  scores.resize(nh * Lp);
  for (int64_t hk = h0; hk < h1; ++hk) {
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, L - t0);
      const T* krow[16];  // a short last block repeats its last token (scores past L are unused)
      for (int64_t j = 0; j < 16; ++j)
        krow[j] = kp + (static_cast<int64_t>(slots[t0 + std::min(j, n - 1)]) * Hkv + hk) * D;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        const float* q = qb + h * D;
        __m512 qv[DV], acc[16];
        for (int c = 0; c < DV; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
        for (int j = 0; j < 16; ++j) {
          acc[j] = _mm512_mul_ps(qv[0], load16(krow[j]));
          for (int c = 1; c < DV; ++c) acc[j] = _mm512_fmadd_ps(qv[c], load16(krow[j] + 16 * c), acc[j]);
        }
        _mm512_storeu_ps(scores.data() + (h - h0 * G) * Lp + t0, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(sc)));
      }
    }
  }
  for (int64_t j = 0; j < nh; ++j) {
    float* row = scores.data() + j * Lp;
    float mx = -FLT_MAX, sum = 0.f;
    for (int64_t t = 0; t < L; ++t) mx = std::max(mx, row[t]);
    for (int64_t t = 0; t < L; ++t) row[t] = exp_le0(row[t] - mx);
    for (int64_t t = 0; t < L; ++t) sum += row[t];
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) row[t] *= inv;
  }
  for (int64_t hk = h0; hk < h1; ++hk) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int64_t ng = std::min<int64_t>(4, G - g0);
      __m512 o[4][DV];
      for (int64_t g = 0; g < 4; ++g)
        for (int c = 0; c < DV; ++c) o[g][c] = _mm512_setzero_ps();
      const float* p = scores.data() + (hk * G + g0 - h0 * G) * Lp;
      for (int64_t t = 0; t < L; ++t) {
        const T* v = vp + (static_cast<int64_t>(slots[t]) * Hkv + hk) * D;
        __m512 vv[DV];
        for (int c = 0; c < DV; ++c) vv[c] = load16(v + 16 * c);
        for (int64_t g = 0; g < ng; ++g) {
          const __m512 pg = _mm512_set1_ps(p[g * Lp + t]);
          for (int c = 0; c < DV; ++c) o[g][c] = _mm512_fmadd_ps(pg, vv[c], o[g][c]);
        }
      }
      for (int64_t g = 0; g < ng; ++g)
        for (int c = 0; c < DV; ++c) _mm512_storeu_ps(ob + (hk * G + g0 + g) * D + 16 * c, o[g][c]);
    }
  }
}
#endif

template <typename T>
static void attend_any(const float* qb, const T* kp, const T* vp, float* ob, const int32_t* slots, int64_t L,
                       int64_t Hkv, int64_t G, int64_t h0, int64_t h1, float sc, std::vector<float>& scores,
                       int64_t D) {
  switch (D) {
#if defined(__AVX512F__)
    case 64: attend_vec<4, T>(qb, kp, vp, ob, slots, L, Hkv, G, h0, h1, sc, scores); break;
    case 128: attend_vec<8, T>(qb, kp, vp, ob, slots, L, Hkv, G, h0, h1, sc, scores); break;
#else
    case 64: attend<64, T>(qb, kp, vp, ob, slots, L, Hkv, G, h0, h1, sc, scores, D); break;
    case 128: attend<128, T>(qb, kp, vp, ob, slots, L, Hkv, G, h0, h1, sc, scores, D); break;
#endif
    default: attend<0, T>(qb, kp, vp, ob, slots, L, Hkv, G, h0, h1, sc, scores, D);
  }
}

// Whole requests per item when there are enough of them (contiguous row reads); else split heads.
static int64_t head_split(int64_t B, int64_t Hkv) { return B >= 4 * at::get_num_threads() ? 1 : Hkv; }

// q [B, H, D] float32; k_buf, v_buf [N, Hkv, D]; req_to_token int32 [R, C]; rows, seq_lens int64 [B].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                               torch::Tensor req_to_token, torch::Tensor rows,
                               torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_buf.scalar_type() == torch::kFloat32,
              "cpu decode_attention: float32 only");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "KV buffers must be contiguous");
  q = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_buf.size(1), G = H / Hkv, C = req_to_token.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_buf.data_ptr<float>();
  const float* vp = v_buf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* r2t = req_to_token.data_ptr<int32_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const int64_t split = head_split(B, Hkv);
  at::parallel_for(0, B * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / split, part = i % split, L = lp[b];
      const int64_t h0 = part * Hkv / split, h1 = (part + 1) * Hkv / split;
      if (L <= 0) continue;
      attend_any<float>(qp + b * H * D, kp, vp, op + b * H * D, r2t + rp[b] * C, L, Hkv, G, h0, h1, sc, scores, D);
    }
  });
  return out;
}

// x * cos + roll(x, D/2) * sin_signed, each op rounded to T as torch's are (sin_signed carries
// rotate_half's sign). x, c, s of dtype T; out float (already rounded to T's precision).
template <typename T>
static inline void rope_row(const T* x, const T* c, const T* s, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const int64_t r = d < half ? d + half : d - half;
    const float a = rnd<T>(tof(x[d]) * tof(c[d]));
    const float b = rnd<T>(tof(x[r]) * tof(s[d]));
    out[d] = rnd<T>(a + b);
  }
}

// Decode with RoPE and the KV store fused in: qkv [B, H + 2 Hkv, D] (rows may be strided) straight
// from the projection; every row's k and v are roped/stored at out_loc in the pool first, then each
// row attends over req_to_token[row, :seq_len] (so rows of one request at consecutive positions, a
// verify batch laid out as decode rows, see each other's keys causally).
// cos, sin [P, D]; positions, out_loc, rows, seq_lens int64 [B].
template <typename T>
static void decode_rope_impl(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& positions, torch::Tensor& k_buf, torch::Tensor& v_buf,
                             const torch::Tensor& out_loc, const torch::Tensor& req_to_token,
                             const torch::Tensor& rows, const torch::Tensor& seq_lens, int64_t H, float sc,
                             torch::Tensor& out) {
  const int64_t B = qkv.size(0), D = qkv.size(2), Hkv = k_buf.size(1), G = H / Hkv, C = req_to_token.size(1);
  const int64_t row_stride = qkv.stride(0);
  const T* qp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* kp = k_buf.data_ptr<T>();
  T* vp = v_buf.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* loc = out_loc.data_ptr<int64_t>();
  const int32_t* r2t = req_to_token.data_ptr<int32_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const int64_t split = head_split(B, Hkv);
  // The new tokens' k (roped) and v into their slots, every row before any attends.
  at::parallel_for(0, B * Hkv, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, hk = i % Hkv;
      const T* row = qp + b * row_stride;
      rope_row<T>(row + (H + hk) * D, cp + pos[b] * D, sp + pos[b] * D, tmp.data(), D);
      T* kd = kp + (loc[b] * Hkv + hk) * D;
      for (int64_t d = 0; d < D; ++d) kd[d] = fromf<T>(tmp[d]);
      std::memcpy(vp + (loc[b] * Hkv + hk) * D, row + (H + Hkv + hk) * D, D * sizeof(T));
    }
  });
  at::parallel_for(0, B * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(H * D), of(H * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / split, part = i % split, L = lp[b];
      const int64_t h0 = part * Hkv / split, h1 = (part + 1) * Hkv / split;
      const T* row = qp + b * row_stride;
      const T* c = cp + pos[b] * D;
      const T* s = sp + pos[b] * D;
      for (int64_t h = h0 * G; h < h1 * G; ++h) rope_row<T>(row + h * D, c, s, qf.data() + h * D, D);
      if (L <= 0) continue;
      attend_any<T>(qf.data(), kp, vp, of.data(), r2t + rp[b] * C, L, Hkv, G, h0, h1, sc, scores, D);
      for (int64_t j = h0 * G * D; j < h1 * G * D; ++j) op[b * H * D + j] = fromf<T>(of[j]);
    }
  });
}

torch::Tensor decode_attention_rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                    torch::Tensor positions, torch::Tensor k_buf, torch::Tensor v_buf,
                                    torch::Tensor out_loc, torch::Tensor req_to_token, torch::Tensor rows,
                                    torch::Tensor seq_lens, int64_t num_heads, double scale) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2),
              "qkv must be [B, heads, D] with contiguous heads");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "KV buffers and RoPE tables must be contiguous");
  TORCH_CHECK(qkv.scalar_type() == k_buf.scalar_type() && qkv.scalar_type() == cos.scalar_type(),
              "qkv, the KV pool and the RoPE tables must share a dtype");
  for (const auto* t : {&positions, &out_loc, &rows, &seq_lens})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() >= qkv.size(0),
                "positions, out_loc, rows and seq_lens must be contiguous int64 [B]");
  TORCH_CHECK(req_to_token.scalar_type() == torch::kInt32 && req_to_token.is_contiguous(), "req_to_token: int32");
  TORCH_CHECK(k_buf.size(1) > 0 && num_heads % k_buf.size(1) == 0 && qkv.size(1) == num_heads + 2 * k_buf.size(1),
              "qkv must hold num_heads q heads and the pool's kv heads twice");
  auto out = torch::empty({qkv.size(0), num_heads, qkv.size(2)}, qkv.options());
  const float sc = static_cast<float>(scale);
  if (qkv.scalar_type() == torch::kFloat32) {
    decode_rope_impl<float>(qkv, cos, sin, positions, k_buf, v_buf, out_loc, req_to_token, rows, seq_lens,
                            num_heads, sc, out);
  } else {
    TORCH_CHECK(qkv.scalar_type() == torch::kBFloat16, "decode_attention_rope: float32 or bfloat16");
    decode_rope_impl<bf16>(qkv, cos, sin, positions, k_buf, v_buf, out_loc, req_to_token, rows, seq_lens,
                           num_heads, sc, out);
  }
  return out;
}

// ------------------------------------------------------------------------------------------
// RMSNorm as transformers computes it: in float32, then weight * x (rounded to T). With a
// residual: residual += x first (rounded to T, in place), and the sum is what is normalised.
template <typename T>
static void rms_rows(const T* x, T* res, const T* w, T* out, int64_t rows, int64_t Hd, int64_t ldx,
                     int64_t ldr, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> h(Hd);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * ldx;
      float ss = 0.f;
      if (res != nullptr) {
        T* rr = res + r * ldr;
        for (int64_t d = 0; d < Hd; ++d) {
          const T v = fromf<T>(tof(rr[d]) + tof(xr[d]));
          rr[d] = v;
          h[d] = tof(v);
        }
      } else {
        for (int64_t d = 0; d < Hd; ++d) h[d] = tof(xr[d]);
      }
      for (int64_t d = 0; d < Hd; ++d) ss += h[d] * h[d];
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(Hd) + eps);
      T* o = out + r * Hd;
      for (int64_t d = 0; d < Hd; ++d) o[d] = fromf<T>(tof(w[d]) * rnd<T>(h[d] * rstd));
    }
  });
}

static torch::Tensor rms_dispatch(const torch::Tensor& x, torch::Tensor* res, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous(), "rms_norm: x [T, H] with unit inner stride");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t ldr = res ? res->stride(0) : 0;
  if (res) TORCH_CHECK(res->stride(1) == 1 && res->scalar_type() == x.scalar_type(), "residual must match x");
  if (x.scalar_type() == torch::kFloat32) {
    rms_rows<float>(x.data_ptr<float>(), res ? res->data_ptr<float>() : nullptr, w.data_ptr<float>(),
                    out.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), ldr, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rms_norm: float32 or bfloat16");
    rms_rows<bf16>(x.data_ptr<bf16>(), res ? res->data_ptr<bf16>() : nullptr, w.data_ptr<bf16>(),
                   out.data_ptr<bf16>(), x.size(0), x.size(1), x.stride(0), ldr, static_cast<float>(eps));
  }
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) { return rms_dispatch(x, nullptr, w, eps); }

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  return rms_dispatch(x, &residual, w, eps);
}

// ------------------------------------------------------------------------------------------
// Greedy sampling: per row the first index of the maximum into ids; the same into void_ids, or
// -1 where the maximum is not finite (NaN or +inf anywhere, or every logit -inf).
// One row: the maximum (NaN anywhere -> NaN) with 16-lane vectors, then its first index.
template <typename T>
static void argmax_row(const T* row, int64_t V, int64_t* id, int64_t* void_id) {
  float best = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = load16(row + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  best = _mm512_reduce_max_ps(mx);
  nan = unordered != 0;
#endif
  for (; i < V; ++i) {
    const float v = tof(row[i]);
    nan |= std::isnan(v);
    best = std::max(best, v);
  }
  int64_t arg = 0;
  if (!nan) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(best);
    for (; j + 16 <= V; j += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(load16(row + j), target, _CMP_EQ_OQ);
      if (hit) break;
    }
#endif
    while (j < V && tof(row[j]) != best) ++j;
    arg = j < V ? j : 0;
  }
  *id = arg;
  *void_id = (nan || !std::isfinite(best)) ? -1 : arg;
}

template <typename T>
static void argmax_impl(const T* lp, int64_t B, int64_t V, int64_t ld, int64_t* ids, int64_t* void_ids) {
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) argmax_row<T>(lp + b * ld, V, ids + b, void_ids + b);
  });
}

void argmax_rows(torch::Tensor logits, torch::Tensor ids, torch::Tensor void_ids) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "argmax_rows: logits [B, V]");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && void_ids.scalar_type() == torch::kInt64 &&
              ids.numel() >= logits.size(0) && void_ids.numel() >= logits.size(0), "argmax_rows: int64 outputs");
  if (logits.scalar_type() == torch::kFloat32) {
    argmax_impl<float>(logits.data_ptr<float>(), logits.size(0), logits.size(1), logits.stride(0),
                       ids.data_ptr<int64_t>(), void_ids.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(logits.scalar_type() == torch::kBFloat16, "argmax_rows: float32 or bfloat16");
    argmax_impl<bf16>(logits.data_ptr<bf16>(), logits.size(0), logits.size(1), logits.stride(0),
                      ids.data_ptr<int64_t>(), void_ids.data_ptr<int64_t>());
  }
}

// ------------------------------------------------------------------------------------------
// Read every byte of a float32 buffer once with all threads (memory bandwidth); returns the sum.
double stream_sum(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, "stream_sum: contiguous float32");
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  const int64_t nt = at::get_num_threads();
  std::vector<double> parts(nt, 0.0);
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
      float acc[32] = {0.f};
      int64_t i = lo;
      for (; i + 32 <= hi; i += 32)
        for (int j = 0; j < 32; ++j) acc[j] += p[i + j];
      float s = 0.f;
      for (int j = 0; j < 32; ++j) s += acc[j];
      for (; i < hi; ++i) s += p[i];
      parts[t] = s;
    }
  });
  double s = 0.0;
  for (double v : parts) s += v;
  return s;
}

// ------------------------------------------------------------------------------------------
// GEMM y [M, N] = x [M, K] @ W^T (+ bias), W packed as [ceil(N/16), K, 16] float32 panels.
// Each y element is one FMA chain over k = 0..K-1 in order, whatever M and the blocking (the
// k blocks pass partial sums through y in float32 exactly), so a row's result never depends on
// the other rows of the batch.
bool gemm_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

torch::Tensor gemm_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "gemm_pack: float32 [N, K]");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NB = (N + 15) / 16;
  auto out = torch::zeros({NB, K, 16}, wc.options());
  const float* s = wc.data_ptr<float>();
  float* d = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t j = 0; j < 16 && nb * 16 + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) d[(nb * K + k) * 16 + j] = s[(nb * 16 + j) * K + k];
  });
  return out;
}

#if defined(__AVX512F__)
// MB rows x NBK panels; k in [k0, k1) of a K-long panel; first: start from 0 (else from y).
template <int MB, int NBK>
static inline void gemm_micro(const float* x, int64_t ldx, const float* w, int64_t K, int64_t k0, int64_t k1,
                              float* y, int64_t ldy, int64_t nvalid, bool first, const float* bias) {
  __m512 acc[MB][NBK];
  __mmask16 mask[NBK];
  for (int j = 0; j < NBK; ++j) {
    const int64_t nv = nvalid - j * 16;
    mask[j] = nv >= 16 ? (__mmask16)0xFFFF : (nv <= 0 ? (__mmask16)0 : (__mmask16)((1u << nv) - 1));
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NBK; ++j)
      acc[m][j] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[j], y + m * ldy + j * 16);
  for (int64_t k = k0; k < k1; ++k) {
    __m512 wv[NBK];
    for (int j = 0; j < NBK; ++j) wv[j] = _mm512_loadu_ps(w + (j * K + k) * 16);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      for (int j = 0; j < NBK; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int j = 0; j < NBK; ++j) {
    if (bias != nullptr) {
      const __m512 bv = _mm512_maskz_loadu_ps(mask[j], bias + j * 16);
      for (int m = 0; m < MB; ++m) acc[m][j] = _mm512_add_ps(acc[m][j], bv);
    }
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy + j * 16, mask[j], acc[m][j]);
  }
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t, int64_t,
                         bool, const float*);
template <int NBK>
static MicroFn micro_upto6(int64_t mb) {
  switch (mb) {
    case 1: return gemm_micro<1, NBK>;
    case 2: return gemm_micro<2, NBK>;
    case 3: return gemm_micro<3, NBK>;
    case 4: return gemm_micro<4, NBK>;
    case 5: return gemm_micro<5, NBK>;
    default: return gemm_micro<6, NBK>;
  }
}
template <int NBK>
static MicroFn micro_upto12(int64_t mb) {
  switch (mb) {
    case 7: return gemm_micro<7, NBK>;
    case 8: return gemm_micro<8, NBK>;
    case 9: return gemm_micro<9, NBK>;
    case 10: return gemm_micro<10, NBK>;
    case 11: return gemm_micro<11, NBK>;
    case 12: return gemm_micro<12, NBK>;
    default: return micro_upto6<NBK>(mb);
  }
}
// At most 24 accumulators: up to 6 rows x 4 panels, or up to 12 rows x 2 panels.
static MicroFn micro(int64_t mb, int64_t nbk) {
  if (nbk == 4) return micro_upto6<4>(mb);
  return nbk == 2 ? micro_upto12<2>(mb) : micro_upto12<1>(mb);
}
#endif

torch::Tensor gemm(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t N) {
#if defined(__AVX512F__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && wp.scalar_type() == torch::kFloat32,
              "gemm: float32 x [M, K]");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0), ldx = x.stride(0);
  TORCH_CHECK(wp.size(1) == K && NB * 16 >= N, "gemm: packed weight does not match x");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->is_contiguous() &&
                                    bias->scalar_type() == at::kFloat), "gemm: bias must be N contiguous floats");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  if (K == 0) return bias.has_value() ? bias->unsqueeze(0).expand({M, N}).contiguous() : y.zero_();
  const float* xp = x.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t nt = at::get_num_threads();
  // Panels per task: 4 (64 columns) unless that leaves threads idle.
  const int64_t G = NB >= 8 * nt ? 4 : (NB >= 4 * nt ? 2 : 1);
  const int64_t NG = (NB + G - 1) / G;
  constexpr int64_t MC = 96, KC = 128;  // rows per task, k per pass: a task's panels stay in L1
  const int64_t MT = (M + MC - 1) / MC;
  at::parallel_for(0, NG * MT, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t ng = t / MT, mt = t % MT;
      const int64_t nb = ng * G, g = std::min(G, NB - nb);
      const int64_t n0 = nb * 16, nvalid = std::min(g * 16, N - n0);
      const int64_t m0 = mt * MC, m1 = std::min(M, m0 + MC);
      const float* wb = w + nb * K * 16;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = std::min(K, k0 + KC);
        const bool first = k0 == 0, last = k1 == K;
        // mb rows against the task's panels, `wide` panels per call (the rest two at a time).
        auto rows = [&](int64_t m, int64_t mb, int64_t wide) {
          for (int64_t j = 0; j < g;) {
            const int64_t nbk = g - j >= wide ? wide : std::min<int64_t>(2, g - j);
            micro(mb, nbk)(xp + m * ldx, ldx, wb + j * K * 16, K, k0, k1, yp + m * N + n0 + j * 16, N,
                           nvalid - j * 16, first, last && bp ? bp + n0 + j * 16 : nullptr);
            j += nbk;
          }
        };
        for (int64_t m = m0; m < m1;) {
          const int64_t rem = m1 - m;
          if (rem > 6 && rem <= 12) {  // the last 7-12 rows in one pass over the weights
            rows(m, rem, 2);
            m += rem;
          } else {
            rows(m, std::min<int64_t>(6, rem), 4);
            m += std::min<int64_t>(6, rem);
          }
        }
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "gemm: this build has no AVX-512");
#endif
}

// ------------------------------------------------------------------------------------------
// bfloat16 GEMM for the few rows of a decode step (AVX512-BF16's dot product of bf16 pairs into
// float32): W packed as [ceil(N/16), K/2, 16, 2] (K even), y rounded to bf16 once at the end, as
// oneDNN's does. oneDNN's own bf16 kernels are several times slower for a row or two here.
bool gemm_bf16_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor gemm_pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.size(1) % 2 == 0,
              "gemm_pack_bf16: bfloat16 [N, K] with K even");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NB = (N + 15) / 16, K2 = K / 2;
  auto out = torch::zeros({NB, K2, 16, 2}, wc.options());
  const bf16* s = wc.data_ptr<bf16>();
  bf16* d = out.data_ptr<bf16>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t j = 0; j < 16 && nb * 16 + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) d[((nb * K2 + k / 2) * 16 + j) * 2 + k % 2] = s[(nb * 16 + j) * K + k];
  });
  return out;
}

#if defined(__AVX512BF16__)
template <int MB, int NBK>
static void gemm_bf16_micro(const bf16* x, int64_t ldx, const bf16* w, int64_t K2, bf16* y, int64_t ldy,
                            int64_t nvalid, const bf16* bias) {
  __m512 acc[MB][NBK];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NBK; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    __m512bh wv[NBK];
    for (int j = 0; j < NBK; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + (j * K2 + p) * 32));
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NBK; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < NBK; ++j) {
    const int64_t nv = nvalid - j * 16;
    if (nv <= 0) break;
    const __mmask16 mask = nv >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nv) - 1);
    __m512 bv = _mm512_setzero_ps();
    if (bias != nullptr) bv = load16(bias + j * 16);  // (reads 16 lanes: bias is padded by the caller)
    for (int m = 0; m < MB; ++m) {
      const __m512 r = bias != nullptr ? _mm512_add_ps(acc[m][j], bv) : acc[m][j];
      _mm256_mask_storeu_epi16(reinterpret_cast<void*>(y + m * ldy + j * 16), mask, (__m256i)_mm512_cvtneps_pbh(r));
    }
  }
}

using MicroBf16 = void (*)(const bf16*, int64_t, const bf16*, int64_t, bf16*, int64_t, int64_t, const bf16*);
template <int NBK>
static MicroBf16 micro_bf16_for(int64_t mb) {
  switch (mb) {
    case 1: return gemm_bf16_micro<1, NBK>;
    case 2: return gemm_bf16_micro<2, NBK>;
    case 3: return gemm_bf16_micro<3, NBK>;
    case 4: return gemm_bf16_micro<4, NBK>;
    case 5: return gemm_bf16_micro<5, NBK>;
    default: return gemm_bf16_micro<6, NBK>;
  }
}
#endif

torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t N) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && wp.scalar_type() == torch::kBFloat16,
              "gemm_bf16: bfloat16 x [M, K]");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0), K2 = wp.size(1), NB = wp.size(0), ldx = x.stride(0);
  TORCH_CHECK(x.size(1) == 2 * K2 && NB * 16 >= N, "gemm_bf16: packed weight does not match x");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  torch::Tensor b;
  if (bias.has_value()) {  // padded to whole panels, so the kernel reads 16 lanes anywhere
    b = torch::zeros({NB * 16}, x.options());
    b.narrow(0, 0, N).copy_(*bias);
  }
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* w = wp.data_ptr<bf16>();
  const bf16* bp = bias.has_value() ? b.data_ptr<bf16>() : nullptr;
  bf16* yp = y.data_ptr<bf16>();
  const int64_t nt = at::get_num_threads();
  const int64_t G = NB >= 8 * nt ? 4 : (NB >= 4 * nt ? 2 : 1);
  const int64_t NG = (NB + G - 1) / G;
  at::parallel_for(0, NG, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t ng = t0; ng < t1; ++ng) {
      const int64_t nb = ng * G, g = std::min(G, NB - nb), n0 = nb * 16, nvalid = std::min(g * 16, N - n0);
      for (int64_t j = 0; j < g;) {
        const int64_t nbk = g - j >= 4 ? 4 : (g - j >= 2 ? 2 : 1);
        for (int64_t m = 0; m < M; m += 6) {
          const int64_t mb = std::min<int64_t>(6, M - m);
          MicroBf16 fn = nbk == 4 ? micro_bf16_for<4>(mb) : nbk == 2 ? micro_bf16_for<2>(mb) : micro_bf16_for<1>(mb);
          fn(xp + m * ldx, ldx, w + (nb + j) * K2 * 32, K2, yp + m * N + n0 + j * 16, N, nvalid - j * 16,
             bp ? bp + n0 + j * 16 : nullptr);
        }
        j += nbk;
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "gemm_bf16: this build has no AVX512-BF16");
#endif
}

// Greedy sampling under a grammar: per row the first index of the maximum over the tokens its
// bitmask allows (int32 words, bit k of word j = token 32 j + k; tokens past the mask are not
// allowed); void_ids -1 where an allowed logit is NaN or no allowed logit is finite.
template <typename T>
static void masked_argmax_impl(const T* lp, int64_t B, int64_t V, int64_t ld, const int32_t* mask, int64_t W,
                               int64_t* ids, int64_t* void_ids) {
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const T* row = lp + b * ld;
      const uint32_t* words = reinterpret_cast<const uint32_t*>(mask + b * W);
      float best = -INFINITY;
      int64_t arg = -1;
      bool nan = false;
      for (int64_t j = 0; j < W && 32 * j < V; ++j) {
        for (uint32_t w = words[j]; w != 0; w &= w - 1) {
          const int64_t t = 32 * j + __builtin_ctz(w);
          if (t >= V) break;
          const float v = tof(row[t]);
          nan |= std::isnan(v);
          if (v > best) best = v, arg = t;
        }
      }
      ids[b] = arg < 0 ? 0 : arg;
      void_ids[b] = (nan || arg < 0 || !std::isfinite(best)) ? -1 : arg;
    }
  });
}

void masked_argmax_rows(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor ids, torch::Tensor void_ids) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "masked_argmax_rows: logits [B, V]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous() &&
              bitmask.size(0) == logits.size(0), "masked_argmax_rows: an int32 bitmask [B, words]");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && void_ids.scalar_type() == torch::kInt64 &&
              ids.numel() >= logits.size(0) && void_ids.numel() >= logits.size(0),
              "masked_argmax_rows: int64 outputs");
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  if (logits.scalar_type() == torch::kFloat32) {
    masked_argmax_impl<float>(logits.data_ptr<float>(), logits.size(0), logits.size(1), logits.stride(0), mask,
                              bitmask.size(1), ids.data_ptr<int64_t>(), void_ids.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(logits.scalar_type() == torch::kBFloat16, "masked_argmax_rows: float32 or bfloat16");
    masked_argmax_impl<bf16>(logits.data_ptr<bf16>(), logits.size(0), logits.size(1), logits.stride(0), mask,
                             bitmask.size(1), ids.data_ptr<int64_t>(), void_ids.data_ptr<int64_t>());
  }
}

// ------------------------------------------------------------------------------------------
// oneDNN's linear over a weight it packed (mkldnn::_linear_pointwise), as one operator of ours:
// inside a compiled graph it is called from C++ (inductor's own lowering of the mkldnn operator
// expects weights it packed itself, and a Python custom op would be a call back into Python).
torch::Tensor onednn_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<c10::optional<c10::Scalar>>(),
                          c10::IValue()};
  op.callBoxed(&stack);
  auto y = stack[0].toTensor();
  TORCH_CHECK(y.dim() == 2 && y.size(1) == n, "onednn_linear: the packed weight has not ", n, " outputs");
  return y;
}

// ------------------------------------------------------------------------------------------
TORCH_LIBRARY_FRAGMENT(radixray, m) {
  m.def("decode_attention_rope(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_buf, "
        "Tensor(b!) v_buf, Tensor out_loc, Tensor req_to_token, Tensor rows, Tensor seq_lens, int num_heads, "
        "float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor w, float eps) -> Tensor");
  m.def("argmax_rows(Tensor logits, Tensor(a!) ids, Tensor(b!) void_ids) -> ()");
  m.def("gemm(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("gemm_bf16(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("onednn_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixray, CPU, m) {
  m.impl("decode_attention_rope", &decode_attention_rope);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("gemm", &gemm);
  m.impl("gemm_bf16", &gemm_bf16);
  m.impl("onednn_linear", &onednn_linear);
}

TORCH_LIBRARY_IMPL(radixray, MkldnnCPU, m) {  // oneDNN's packed weight is an MKLDNN-layout tensor
  m.impl("onednn_linear", &onednn_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: they run without the GIL, so the scheduler thread keeps
  // going while the overlap forward thread computes.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, nogil, "paged decode attention (CPU, float32)");
  m.def("decode_attention_rope", &decode_attention_rope, nogil, "RoPE + KV store + paged decode attention");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm");
  m.def("add_rms_norm", &add_rms_norm, nogil, "residual += x; RMSNorm(residual)");
  m.def("argmax_rows", &argmax_rows, nogil, "greedy ids, -1 for non-finite rows");
  m.def("masked_argmax_rows", &masked_argmax_rows, nogil, "greedy ids over the tokens a bitmask allows");
  m.def("stream_sum", &stream_sum, "read a buffer with every thread");
  m.def("gemm_available", &gemm_available, "the AVX-512 GEMM is built");
  m.def("gemm_pack", &gemm_pack, "pack W [N, K] into 16-column panels");
  m.def("gemm", &gemm, nogil, "x @ W^T (+ bias) over packed W");
  m.def("gemm_bf16_available", &gemm_bf16_available, "the AVX512-BF16 GEMM is built");
  m.def("gemm_pack_bf16", &gemm_pack_bf16, "pack bf16 W [N, K] into 16-column panels of k pairs");
  m.def("gemm_bf16", &gemm_bf16, nogil, "x @ W^T (+ bias), bfloat16, over packed W");
}
"""

# -ffp-contract=off: no fused multiply-adds the source does not ask for, so elementwise math
# rounds as torch's separate ops do (the GEMM calls FMA explicitly).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-ffp-contract=off"]
STALE_LOCK_S = 180
_lock = threading.Lock()
_state: dict[str, object] = {}


def load():
    """The compiled module (its operators registered as torch.ops.radixray.*), or None if disabled
    or it cannot be built here."""
    if os.environ.get("RADIXRAY_CPU_KERNELS", "1") == "0":
        return None
    with _lock:
        if "module" not in _state:
            _state["module"] = module = _build()
            if module is not None:
                _register_fakes()
        return _state["module"]


def load_error() -> str | None:
    """Why the last build failed, if it did."""
    return _state.get("error")


def cpu_signature() -> str:
    """The machine and its instruction-set flags: -march=native code built on one CPU may not run
    on another (SIGILL), so the build is keyed by this (a node of another kind builds its own)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features"):  # x86, ARM
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def build_digest() -> str:
    key = "\n".join([_SOURCE, " ".join(_FLAGS), torch.__version__, cpu_signature()])
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _build():
    digest = build_digest()
    build_dir = os.path.join(cache_dir(), "torch_extensions", f"cpu_kernels_{digest}")
    os.makedirs(build_dir, exist_ok=True)
    # torch's build lock is a plain file: a process killed mid-build leaves it behind and every
    # later load would wait on it forever. A build takes well under a minute here.
    lock = os.path.join(build_dir, "lock")
    if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
        os.remove(lock)
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(name=f"radixray_cpu_kernels_{digest}", cpp_sources=[_SOURCE], functions=None,
                           extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=False)
    except Exception as e:  # no compiler, no ninja, ...: the torch path still works
        _state["error"] = f"{type(e).__name__}: {e}"
        return None


def _register_fakes() -> None:
    """Shapes of the operators' outputs, for tracing (torch.compile)."""

    @torch.library.register_fake("radixray::decode_attention_rope")
    def _(qkv, cos, sin, positions, k_buf, v_buf, out_loc, req_to_token, rows, seq_lens, num_heads, scale):
        return qkv.new_empty(qkv.shape[0], num_heads, qkv.shape[2])

    @torch.library.register_fake("radixray::rms_norm")
    def _(x, w, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("radixray::add_rms_norm")
    def _(x, residual, w, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("radixray::argmax_rows")
    def _(logits, ids, void_ids):
        return None

    @torch.library.register_fake("radixray::gemm")
    def _(x, w, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("radixray::gemm_bf16")
    def _(x, w, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("radixray::onednn_linear")
    def _(x, packed, bias, n):
        return x.new_empty(x.shape[0], n)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D] (float32); attends over req_to_token[row, :seq_len] of each request."""
    return load().decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale)


# The operators below call the module directly when eager (a pybind call costs a few microseconds
# less than a torch.ops dispatch, and a decode step makes dozens) and through torch.ops while
# torch.compile traces, where they must be graph nodes. load() must have succeeded first.
def _eager(name: str):
    return getattr(_state["module"], name)


def decode_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          k_buf: torch.Tensor, v_buf: torch.Tensor, out_loc: torch.Tensor, req_to_token: torch.Tensor,
                          rows: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
    """qkv [B, H + 2 Hkv, D] before RoPE -> attention output [B, H, D]; k/v roped and stored at out_loc."""
    fn = torch.ops.radixray.decode_attention_rope if torch.compiler.is_compiling() else _eager("decode_attention_rope")
    return fn(qkv, cos, sin, positions, k_buf, v_buf, out_loc, req_to_token, rows, seq_lens, num_heads, scale)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    fn = torch.ops.radixray.rms_norm if torch.compiler.is_compiling() else _eager("rms_norm")
    return fn(x, w, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns RMSNorm(residual) * w."""
    fn = torch.ops.radixray.add_rms_norm if torch.compiler.is_compiling() else _eager("add_rms_norm")
    return fn(x, residual, w, eps)


def gemm(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) over W packed by gemm_pack: [M, n]."""
    fn = torch.ops.radixray.gemm if torch.compiler.is_compiling() else _eager("gemm")
    return fn(x, panels, bias, n)


def gemm_bf16(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """bfloat16 x [M, K] @ W^T (+ bias) over W packed by gemm_pack_bf16: [M, n]."""
    fn = torch.ops.radixray.gemm_bf16 if torch.compiler.is_compiling() else _eager("gemm_bf16")
    return fn(x, panels, bias, n)


def argmax_rows(logits: torch.Tensor, ids: torch.Tensor, void_ids: torch.Tensor) -> None:
    """Per row the argmax into ids, and into void_ids too, or -1 where the row is not finite."""
    _eager("argmax_rows")(logits, ids, void_ids)


def masked_argmax_rows(logits: torch.Tensor, bitmask: torch.Tensor, ids: torch.Tensor, void_ids: torch.Tensor) -> None:
    """argmax_rows over the tokens an int32 token bitmask [B, words] allows per row."""
    _eager("masked_argmax_rows")(logits, bitmask, ids, void_ids)


def stream_read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Best bytes/s of `repeats` reads of a fresh float32 buffer of `nbytes` with every thread."""
    mod = load()
    if mod is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {load_error() or 'RADIXRAY_CPU_KERNELS=0'}")
    buf = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mod.stream_sum(buf)
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best
