// Linear layers on the CPU: the float32 GEMM (AVX-512) and the bfloat16 one (AVX512-BF16) over
// weights packed once into 16-column panels, and oneDNN's linear over a weight it packed.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "common.h"

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
