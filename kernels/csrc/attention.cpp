// Paged decode attention over the token-level KV pool, and its fused form with RoPE and the KV
// store (one call per layer of a decode step).
#include "common.h"

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

// Each of `rows` rows of `len` scores, `stride` floats apart, becomes its softmax in place.
static inline void softmax_rows(float* scores, int64_t rows, int64_t stride, int64_t len) {
  for (int64_t j = 0; j < rows; ++j) {
    float* row = scores + j * stride;
    float mx = -FLT_MAX, sum = 0.f;
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, row[t]);
    for (int64_t t = 0; t < len; ++t) row[t] = exp_le0(row[t] - mx);
    for (int64_t t = 0; t < len; ++t) sum += row[t];
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) row[t] *= inv;
  }
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
  softmax_rows(scores.data(), nh, L, L);
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
  softmax_rows(scores.data(), nh, Lp, L);
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
