// Quantized linear: y [M, N] = x [M, K] @ dequantize(W)^T with W in the engine's block format
// (kernels/quant.py): 4-bit nibble chunks in GGUF's Q4 layout or int8 codes, one scale and an
// optional bias per group of G elements of a row, value = scale * q + bias.
//
// Two algorithms, chosen by the row count alone:
// - M <= QGEMM_INT8_MAX_ROWS (decode): each row of x quantized to int8 per 32-element block
//   (llama.cpp's Q8_0: dx = max|x| / 127), integer dot products against the codes (AVX2's
//   maddubs), acc += isum * (scale * dx) per block; a group's bias multiplies the float sum of
//   x over the group. Each weight block is unpacked once for up to four rows, the weight read
//   once per call: a decode step's time goes to reading weights.
// - Larger M (prefill): 32-column tiles of W dequantized to float32 (exactly the reference's
//   values) into 16-column panels, then a 6 x 16 FMA kernel over them.
// Within each algorithm an output element is computed by the same instructions in the same order
// whatever M and the other rows are: a row alone gives the same bits as within a batch of the
// same algorithm. The two algorithms differ (int8 activations vs float): a row's result depends
// on whether its call has at most QGEMM_INT8_MAX_ROWS rows.
#include "common.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;          // elements per activation block (and per 4-bit chunk)
constexpr int64_t kMaxRowsInt = 16;  // QGEMM_INT8_MAX_ROWS
constexpr int64_t kRowsPerPass = 4;  // rows sharing one unpacked weight block (integer path)

struct QW {
  const uint8_t* q;  // codes: row n starts at q + n * ldq
  int64_t ldq;
  const void* s;  // scales [N, ng]
  bool s16;
  const void* b;  // biases [N, ng] or nullptr
  bool b16;
  int64_t bits, G, K, ng;
};

// n values of a float16 or float32 array from offset off, as float (float16 -> float is exact).
inline void to_float(const void* p, bool half, int64_t off, int64_t n, float* out) {
  if (!half) {
    std::memcpy(out, static_cast<const float*>(p) + off, n * sizeof(float));
    return;
  }
  const c10::Half* h = static_cast<const c10::Half*>(p) + off;
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
#if defined(__F16C__)
  for (; i < n; ++i) out[i] = _cvtsh_ss(h[i].x);
#else
  for (; i < n; ++i) out[i] = static_cast<float>(h[i]);
#endif
}

// A column's scales and biases as float, zero padded to whole 8-lane vectors.
inline void column_params(const QW& w, int64_t n, float* sc, float* bi, int64_t ngp) {
  to_float(w.s, w.s16, n * w.ng, w.ng, sc);
  std::fill(sc + w.ng, sc + ngp, 0.f);
  if (w.b != nullptr) {
    to_float(w.b, w.b16, n * w.ng, w.ng, bi);
    std::fill(bi + w.ng, bi + ngp, 0.f);
  }
}

inline int64_t pad8(int64_t n) { return (n + 7) / 8 * 8; }

#if defined(__AVX2__)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 4-bit codes of one chunk (16 bytes) as bytes 0..15 in element order.
inline __m256i unpack_q4(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
}
#endif

// ---- integer path: activations quantized per row ----

// Elements per scale slot of the integer path: a 32-block, or a 16-half where groups do not
// cover whole blocks (G = 16: GGUF's Q6_K; G = 48, ...). A slot lies in one group.
inline int64_t slot_size(int64_t G) { return G % QK == 0 ? QK : 16; }

struct QActs {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d;   // [M, ldd]: dx of each scale slot (a 32-block's twice for 16-slots), zero padded
  std::vector<float> gs;  // [M, ngp]: sum of x over each group (biased formats), zero padded
  int64_t ldd = 0, ngp = 0;
};

void quantize_rows(const float* x, int64_t ldx, int64_t M, const QW& w, bool sums, QActs& a) {
  const int64_t K = w.K, nb = K / QK, G = w.G, per = QK / slot_size(G);
  a.ldd = pad8(K / slot_size(G));
  a.ngp = pad8(w.ng);
  a.q.resize(M * K);
  a.d.assign(M * a.ldd, 0.f);
  if (sums) a.gs.assign(M * a.ngp, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    int8_t* qr = a.q.data() + m * K;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xr + b * QK;
#if defined(__AVX2__)
      __m256 v[4];
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
#else
      float amax = 0.f;
      for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      for (int64_t j = 0; j < per; ++j) a.d[m * a.ldd + b * per + j] = d;
#if defined(__AVX2__)
      const __m256 idv = _mm256_set1_ps(id);
      __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], idv));  // round to nearest even
      __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], idv));
      __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], idv));
      __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], idv));
      i0 = _mm256_packs_epi32(i0, i1);
      i2 = _mm256_packs_epi32(i2, i3);
      i0 = _mm256_packs_epi16(i0, i2);
      i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + b * QK), i0);
#else
      for (int64_t i = 0; i < QK; ++i)
        qr[b * QK + i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(xb[i] * id))));
#endif
    }
    if (!sums) continue;
    float* gr = a.gs.data() + m * a.ngp;
    for (int64_t g = 0; g < w.ng; ++g) {  // G is a multiple of 16: whole 8-lane vectors
      const float* xg = xr + g * G;
#if defined(__AVX2__)
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < G; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(xg + i));
      gr[g] = hsum8(acc);
#else
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < G; i += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += xg[i + l];
      gr[g] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
    }
  }
}

// R (<= 4) rows of quantized x against one column's codes wq: y[r] = sum over blocks of
// isum * d[r][slot] (d = weight scale * dx, a table the caller fills per column; isum the
// block's 8 partial integer sums of 4 elements each) + sum over groups of bias * (sum of x).
// Even and odd blocks go to two accumulators (one FMA chain would wait on its latency at one
// row), added before the bias terms and the lanes' sum. S16: 16-element slots (two per block,
// lanes 0-3 and 4-7). bi: [ngp] or nullptr; gs: [R][ngp].
template <int BITS, bool S16, int R>
void int_rows(const uint8_t* wq, const int8_t* xq, int64_t K, const float* d, int64_t ldd, const float* bi,
              const float* gs, int64_t ngp, float* y, int64_t ldy) {
  const int64_t nb = K / QK;
#if defined(__AVX2__)
  __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
#define QG_ROW(r, ACC)                                                                                  \
  if (R > r) {                                                                                          \
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * QK));      \
    /* u8 x s8 pairs -> s16 (no saturation: |q| <= 128, |x| <= 127), then pairs -> s32 */              \
    const __m256i p = BITS == 4 ? _mm256_maddubs_epi16(wv, xv)                                          \
                                : _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv));                 \
    const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));                                    \
    const float* dp = d + r * ldd;                                                                      \
    const __m256 dv =                                                                                   \
        S16 ? _mm256_permutevar8x32_ps(                                                                 \
                  _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(dp + 2 * b))), halves) \
            : _mm256_broadcast_ss(dp + b);                                                              \
    ACC = _mm256_fmadd_ps(f, dv, ACC);                                                                  \
  }
#define QG_BLOCK(A0, A1, A2, A3)                                              \
  {                                                                           \
    __m256i wv, wabs;                                                         \
    if (BITS == 4) {                                                          \
      wv = wabs = unpack_q4(wq + b * (QK / 2));                               \
    } else {                                                                  \
      wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * QK)); \
      wabs = _mm256_abs_epi8(wv);                                             \
    }                                                                         \
    QG_ROW(0, A0) QG_ROW(1, A1) QG_ROW(2, A2) QG_ROW(3, A3)                   \
  }
  int64_t b = 0;
  for (; b + 1 < nb; ++b) {
    QG_BLOCK(e0, e1, e2, e3)
    ++b;
    QG_BLOCK(o0, o1, o2, o3)
  }
  if (b < nb) QG_BLOCK(e0, e1, e2, e3)
#undef QG_BLOCK
#undef QG_ROW
  __m256 s[4] = {_mm256_add_ps(e0, o0), _mm256_add_ps(e1, o1), _mm256_add_ps(e2, o2), _mm256_add_ps(e3, o3)};
  for (int r = 0; r < R; ++r) {
    if (bi != nullptr)
      for (int64_t g = 0; g < ngp; g += 8)
        s[r] = _mm256_fmadd_ps(_mm256_loadu_ps(bi + g), _mm256_loadu_ps(gs + r * ngp + g), s[r]);
    y[r * ldy] = hsum8(s[r]);
  }
#else
  for (int r = 0; r < R; ++r) {
    float lanes[2][8] = {};
    for (int64_t b = 0; b < nb; ++b) {
      for (int l = 0; l < 8; ++l) {  // lane l: elements 4l..4l+3 of the block, as the AVX2 path
        int32_t isum = 0;
        for (int e = 4 * l; e < 4 * l + 4; ++e) {
          const int32_t q = BITS == 4 ? (e < 16 ? wq[b * 16 + e] & 0xF : wq[b * 16 + e - 16] >> 4)
                                      : static_cast<int8_t>(wq[b * QK + e]);
          isum += q * xq[r * K + b * QK + e];
        }
        const float dv = S16 ? d[r * ldd + 2 * b + (l >= 4)] : d[r * ldd + b];
        lanes[b % 2][l] = std::fma(static_cast<float>(isum), dv, lanes[b % 2][l]);
      }
    }
    float t[8];
    for (int l = 0; l < 8; ++l) t[l] = lanes[0][l] + lanes[1][l];
    if (bi != nullptr)
      for (int64_t g = 0; g < ngp; g += 8)
        for (int l = 0; l < 8; ++l) t[l] = std::fma(bi[g + l], gs[r * ngp + g + l], t[l]);
    y[r * ldy] = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));  // as hsum8
  }
#endif
}

using IntRowsFn = void (*)(const uint8_t*, const int8_t*, int64_t, const float*, int64_t, const float*, const float*,
                           int64_t, float*, int64_t);
template <int BITS, bool S16>
IntRowsFn int_rows_for(int64_t r) {
  switch (r) {
    case 1: return int_rows<BITS, S16, 1>;
    case 2: return int_rows<BITS, S16, 2>;
    case 3: return int_rows<BITS, S16, 3>;
    default: return int_rows<BITS, S16, 4>;
  }
}

// Eight float16/float32 values p[off..off+8) as float into out, zeros past `avail`.
inline void load8(const void* p, bool half, int64_t off, int64_t avail, float* out) {
  const int64_t n = std::min<int64_t>(8, avail);
  to_float(p, half, off, n, out);
  std::fill(out + n, out + 8, 0.f);
}

#if defined(__AVX2__) && defined(__F16C__)
inline __m256 load8v(const void* p, bool half, int64_t off, int64_t avail) {
  if (avail >= 8)
    return half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const c10::Half*>(p) + off)))
                : _mm256_loadu_ps(static_cast<const float*>(p) + off);
  float t[8];
  load8(p, half, off, avail, t);
  return _mm256_loadu_ps(t);
}
#endif

void qgemm_int(const float* x, int64_t ldx, int64_t M, const QW& w, int64_t N, float* y) {
  QActs a;
  const bool biased = w.b != nullptr;
  quantize_rows(x, ldx, M, w, biased, a);
  const int64_t K = w.K, slot = slot_size(w.G), nslot = K / slot, ldd = a.ldd, ngp = a.ngp, ng = w.ng;
  const bool expand = w.G != slot;  // a group spans several slots: its scale repeated per slot
  IntRowsFn fns[kRowsPerPass + 1];
  for (int64_t r = 1; r <= kRowsPerPass; ++r)
    fns[r] = w.bits == 4 ? int_rows_for<4, false>(r) : slot == 16 ? int_rows_for<8, true>(r) : int_rows_for<8, false>(r);
  // Columns per task: enough work that a task outweighs its scheduling.
  const int64_t grain = std::max<int64_t>(8, 16384 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> sc(expand ? ldd + 8 : 0), bi(ngp), d(M * ldd);
    for (int64_t n = n0; n < n1; ++n) {
      if (expand) {
        float g1;
        for (int64_t g = 0, j = 0; g < ng; ++g) {
          to_float(w.s, w.s16, n * ng + g, 1, &g1);
          for (int64_t e = j + w.G / slot; j < e; ++j) sc[j] = g1;
        }
        std::fill(sc.begin() + nslot, sc.end(), 0.f);
      }
      for (int64_t j = 0; j < ldd; j += 8) {  // d = scale * dx, per row and scale slot
#if defined(__AVX2__) && defined(__F16C__)
        const __m256 s8 = expand ? _mm256_loadu_ps(sc.data() + j) : load8v(w.s, w.s16, n * ng + j, ng - j);
        for (int64_t m = 0; m < M; ++m)
          _mm256_storeu_ps(d.data() + m * ldd + j, _mm256_mul_ps(s8, _mm256_loadu_ps(a.d.data() + m * ldd + j)));
#else
        float s8[8];
        if (expand) std::copy(sc.begin() + j, sc.begin() + j + 8, s8);
        else load8(w.s, w.s16, n * ng + j, ng - j, s8);
        for (int64_t m = 0; m < M; ++m)
          for (int e = 0; e < 8; ++e) d[m * ldd + j + e] = s8[e] * a.d[m * ldd + j + e];
#endif
      }
      if (biased)
        for (int64_t g = 0; g < ngp; g += 8) {
#if defined(__AVX2__) && defined(__F16C__)
          _mm256_storeu_ps(bi.data() + g, load8v(w.b, w.b16, n * ng + g, ng - g));
#else
          load8(w.b, w.b16, n * ng + g, ng - g, bi.data() + g);
#endif
        }
      const uint8_t* wq = w.q + n * w.ldq;
      // passes of at most kRowsPerPass rows, as even as can be (more accumulators per pass)
      const int64_t passes = (M + kRowsPerPass - 1) / kRowsPerPass;
      for (int64_t i = 0, m = 0; i < passes; ++i) {
        const int64_t r = (M - m + (passes - i) - 1) / (passes - i);
        fns[r](wq, a.q.data() + m * K, K, d.data() + m * ldd, ldd, biased ? bi.data() : nullptr,
               a.gs.data() + m * ngp, ngp, y + m * N + n, N);
        m += r;
      }
    }
  });
}

// ---- float path: W dequantized tile by tile into 16-column panels ----

constexpr int64_t NR = 16;   // columns per panel (two 8-lane vectors)
constexpr int64_t NCT = 32;  // columns per task tile (two panels)
constexpr int64_t KC = 256;  // k per pass: a panel's slice (16 KiB) stays in L1
constexpr int64_t MC = 96;   // rows per pass: their KC-slice of x (96 KiB) stays in L2

// Column n of W as float32 [K] (scale * q, then + bias: the reference's two roundings).
void dequant_col(const QW& w, int64_t n, float* o, float* sc, float* bi) {
  const int64_t K = w.K, G = w.G, per = QK / 8;  // 8-lane pieces per block
  column_params(w, n, sc, bi, pad8(w.ng));
  const uint8_t* wq = w.q + n * w.ldq;
  const bool biased = w.b != nullptr;
  for (int64_t b = 0, g = 0, left = G; b < K / QK; ++b) {
    float* ob = o + b * QK;
#if defined(__AVX2__)
    const __m256i codes = w.bits == 4 ? unpack_q4(wq + b * 16)
                                      : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * QK));
    const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
    for (int i = 0; i < per; ++i) {
      const __m128i h = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
      const __m256i qi = w.bits == 4 ? _mm256_cvtepu8_epi32(h) : _mm256_cvtepi8_epi32(h);
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(qi), _mm256_broadcast_ss(sc + g));
      if (biased) v = _mm256_add_ps(v, _mm256_broadcast_ss(bi + g));
      _mm256_storeu_ps(ob + 8 * i, v);
      if ((left -= 8) == 0) ++g, left = G;
    }
#else
    for (int64_t e = 0; e < QK; ++e) {
      const int32_t q = w.bits == 4 ? (e < 16 ? wq[b * 16 + e] & 0xF : wq[b * 16 + e - 16] >> 4)
                                    : static_cast<int8_t>(wq[b * QK + e]);
      float v = static_cast<float>(q) * sc[g];
      if (biased) v = v + bi[g];
      ob[e] = v;
      if (--left == 0) ++g, left = G;
    }
#endif
  }
}

// Columns n0..n0+nc-1 of W dequantized into panels [ceil(nc / 16)][K][16], columns past nc zero.
// cols: scratch [8][K]; sc, bi: scratch for a column's parameters.
void dequant_panels(const QW& w, int64_t n0, int64_t nc, float* out, float* cols, float* sc, float* bi) {
  const int64_t K = w.K;
  for (int64_t c0 = 0; c0 < nc; c0 += 8) {  // eight columns at a time, transposed into the panel
    for (int64_t i = 0; i < 8; ++i) {
      if (c0 + i < nc) dequant_col(w, n0 + c0 + i, cols + i * K, sc, bi);
      else std::fill(cols + i * K, cols + (i + 1) * K, 0.f);
    }
    float* dst = out + (c0 / NR) * K * NR + c0 % NR;
    for (int64_t k = 0; k < K; k += 8) {
#if defined(__AVX2__)
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(cols + i * K + k);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + (k + i) * NR, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (k + i + 4) * NR, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
#else
      for (int64_t kk = k; kk < k + 8; ++kk)
        for (int64_t i = 0; i < 8; ++i) dst[kk * NR + i] = cols[i * K + kk];
#endif
    }
  }
  if (nc % NR != 0 && nc % NR <= 8) {  // the last panel's upper half
    float* dst = out + (nc / NR) * K * NR + 8;
    for (int64_t k = 0; k < K; ++k) std::fill(dst + k * NR, dst + k * NR + 8, 0.f);
  }
}

#if defined(__AVX2__)
inline __m256i lane_mask(int64_t valid) {  // lanes below `valid` set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

// MB (<= 6) rows x one 16-column panel over k0..k0+kc: y = (first ? 0 : y) + x @ panel, each
// element one FMA chain over k in order (the k passes hand it on through y exactly), so a row's
// result depends on nothing but the row. nvalid: the panel's real columns.
template <int MB>
void micro16(const float* x, int64_t ldx, const float* p, int64_t kc, float* y, int64_t ldy, int64_t nvalid,
             bool first) {
#if defined(__AVX2__)
  const bool full = nvalid >= NR;
  const __m256i ma = lane_mask(nvalid), mb = lane_mask(nvalid - 8);
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0;
  __m256 a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
#define QG_LOAD(r, A, B)                                                          \
  if (MB > r && !first) {                                                         \
    A = full ? _mm256_loadu_ps(y + r * ldy) : _mm256_maskload_ps(y + r * ldy, ma); \
    B = full ? _mm256_loadu_ps(y + r * ldy + 8) : _mm256_maskload_ps(y + r * ldy + 8, mb); \
  }
  QG_LOAD(0, a0, b0) QG_LOAD(1, a1, b1) QG_LOAD(2, a2, b2) QG_LOAD(3, a3, b3) QG_LOAD(4, a4, b4) QG_LOAD(5, a5, b5)
#undef QG_LOAD
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 wa = _mm256_loadu_ps(p + k * NR), wb = _mm256_loadu_ps(p + k * NR + 8);
#define QG_FMA(r, A, B)                                      \
  if (MB > r) {                                              \
    const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k); \
    A = _mm256_fmadd_ps(xb, wa, A);                          \
    B = _mm256_fmadd_ps(xb, wb, B);                          \
  }
    QG_FMA(0, a0, b0) QG_FMA(1, a1, b1) QG_FMA(2, a2, b2) QG_FMA(3, a3, b3) QG_FMA(4, a4, b4) QG_FMA(5, a5, b5)
#undef QG_FMA
  }
#define QG_STORE(r, A, B)                                 \
  if (MB > r) {                                           \
    if (full) {                                           \
      _mm256_storeu_ps(y + r * ldy, A);                   \
      _mm256_storeu_ps(y + r * ldy + 8, B);               \
    } else {                                              \
      _mm256_maskstore_ps(y + r * ldy, ma, A);            \
      _mm256_maskstore_ps(y + r * ldy + 8, mb, B);        \
    }                                                     \
  }
  QG_STORE(0, a0, b0) QG_STORE(1, a1, b1) QG_STORE(2, a2, b2) QG_STORE(3, a3, b3) QG_STORE(4, a4, b4)
  QG_STORE(5, a5, b5)
#undef QG_STORE
#else
  for (int r = 0; r < MB; ++r)
    for (int64_t j = 0; j < std::min(nvalid, NR); ++j) {
      float acc = first ? 0.f : y[r * ldy + j];
      for (int64_t k = 0; k < kc; ++k) acc = std::fma(x[r * ldx + k], p[k * NR + j], acc);
      y[r * ldy + j] = acc;
    }
#endif
}

using Micro16 = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, bool);
Micro16 micro16_for(int64_t mb) {
  switch (mb) {
    case 1: return micro16<1>;
    case 2: return micro16<2>;
    case 3: return micro16<3>;
    case 4: return micro16<4>;
    case 5: return micro16<5>;
    default: return micro16<6>;
  }
}

void qgemm_float(const float* x, int64_t ldx, int64_t M, const QW& w, int64_t N, float* y) {
  const int64_t K = w.K;
  const int64_t NT = (N + NCT - 1) / NCT;
  // Row ranges per tile: all rows, unless that leaves threads idle (each range dequantizes its
  // own copy of the tile).
  const int64_t nt = at::get_num_threads();
  const int64_t MT = NT >= 4 * nt ? 1 : std::min((M + 47) / 48, (4 * nt + NT - 1) / NT);
  const int64_t MS = (M + MT - 1) / MT;
  at::parallel_for(0, NT * MT, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> panels(NCT * K), cols(8 * K), sc(pad8(w.ng)), bi(pad8(w.ng));
    int64_t have = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t tile = t / MT, mt = t % MT;
      const int64_t n0 = tile * NCT, nc = std::min(NCT, N - n0);
      if (have != tile) {
        dequant_panels(w, n0, nc, panels.data(), cols.data(), sc.data(), bi.data());
        have = tile;
      }
      const int64_t mend = std::min(M, (mt + 1) * MS);
      for (int64_t mc = mt * MS; mc < mend; mc += MC) {
        const int64_t m1 = std::min(mend, mc + MC);
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t kc = std::min(KC, K - k0);
          for (int64_t pn = 0; pn * NR < nc; ++pn) {
            const float* p = panels.data() + (pn * K + k0) * NR;
            // passes of at most 6 rows, as even as can be (a pass of one or two rows has too few
            // accumulators to hide the FMA latency)
            const int64_t passes = (m1 - mc + 5) / 6;
            for (int64_t i = 0, m = mc; i < passes; ++i) {
              const int64_t mb = (m1 - m + (passes - i) - 1) / (passes - i);
              micro16_for(mb)(x + m * ldx + k0, ldx, p, kc, y + m * N + n0 + pn * NR, N, nc - pn * NR, k0 == 0);
              m += mb;
            }
          }
        }
      }
    }
  });
}

}  // namespace

int64_t qgemm_int8_max_rows() { return kMaxRowsInt; }

torch::Tensor qgemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, c10::optional<torch::Tensor> biases,
                    int64_t bits, int64_t group_size, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 8, "qgemm: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2, "qgemm: x must be [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(0) == n && qweight.stride(1) == 1 &&
                  qweight.scalar_type() == (bits == 4 ? torch::kUInt8 : torch::kInt8),
              "qgemm: codes must be ", bits == 4 ? "uint8 [N, K / 2]" : "int8 [N, K]", " with unit inner stride");
  const int64_t K = qweight.size(1) * (bits == 4 ? 2 : 1);
  TORCH_CHECK(x.size(1) == K, "qgemm: x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(K % QK == 0 && group_size > 0 && group_size % (bits == 4 ? 32 : 16) == 0 && K % group_size == 0,
              "qgemm: bad group size ", group_size, " for K=", K);
  const int64_t ng = K / group_size;
  auto check_params = [&](const torch::Tensor& t, const char* what) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == ng && t.is_contiguous() &&
                    (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kFloat16),
                "qgemm: ", what, " must be contiguous float16/float32 [N, K / group_size]");
  };
  check_params(scales, "scales");
  if (biases.has_value()) check_params(*biases, "biases");
  if (x.scalar_type() != torch::kFloat32) x = x.to(torch::kFloat32);
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0);
  auto y = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const QW w{static_cast<const uint8_t*>(qweight.data_ptr()),
             qweight.stride(0),
             scales.data_ptr(),
             scales.scalar_type() == torch::kFloat16,
             biases.has_value() ? biases->data_ptr() : nullptr,
             biases.has_value() && biases->scalar_type() == torch::kFloat16,
             bits,
             group_size,
             K,
             ng};
  if (M <= kMaxRowsInt)
    qgemm_int(x.data_ptr<float>(), x.stride(0), M, w, n, y.data_ptr<float>());
  else
    qgemm_float(x.data_ptr<float>(), x.stride(0), M, w, n, y.data_ptr<float>());
  return y;
}
