// Row-wise kernels: RMSNorm (with the residual add fused in), greedy argmax (plain, and over the
// tokens a grammar bitmask allows), and a streaming read of a buffer (the memory bandwidth).
#include "common.h"

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
