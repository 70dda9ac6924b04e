// Quantized linear: y [M, N] = x [M, K] @ dequantize(W)^T with W in the engine's block format
// (kernels/quant.py): 4-bit nibble chunks in GGUF's Q4 layout or int8 codes, one scale and an
// optional bias per group of G elements of a row, value = scale * q + bias.
//
// One algorithm for every M. Each row of x is quantized to int16 per 32-element block (dx =
// max|x| / 32767: a relative error near 1e-5, so greedy tokens follow the float model's, where int8
// activations flip near-ties); integer dot products against the codes (AVX2's madd_epi16 on the
// codes widened to 16 bits) give per block 8 lanes of 4-element sums, and acc += float(isum) * (scale * dx) per block (one FMA
// chain per output element over the blocks in order); a group's bias multiplies the float sum of
// x over the group (FMAs into the same accumulator after the blocks); the 8 lanes are summed in
// one fixed tree. An output element is computed by exactly this instruction sequence whatever M,
// the other rows and the tiling: a row alone gives the same bits as inside any batch.
// Tiles are 4 columns x up to 3 rows (8 columns for a single row: more independent FMA chains):
// the x block and dx loads are shared by the tile's columns, a weight block is unpacked once for
// all its rows, and the lanes of 4 columns are summed by one hadd tree. Each thread takes one
// contiguous range of columns (few rows) or of rows (many); within it columns go in chunks
// (their scales as float tables; for calls of at most 3 rows, the products scale * dx too) and
// rows in chunks whose int16 x stays in L2. The first row tile of each column tile prefetches the
// next column tile's codes.
#include "common.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif


namespace {

constexpr int64_t QK = 32;     // elements per activation block (and per 4-bit chunk)
constexpr int64_t kCols = 4;   // columns per tile
constexpr int64_t kRows = 3;   // rows per tile at most (4 x 3 accumulators fill the registers)
constexpr int64_t kChunkCols = 64;  // columns whose scale/bias tables a task builds at once

struct QW {
  const uint8_t* q;  // codes: row n starts at q + n * ldq
  int64_t ldq;
  const void* s;  // scales [N, ng]
  bool s16;
  const void* b;  // biases [N, ng] or nullptr
  bool b16;
  int64_t bits, G, K, ng;
};

inline int64_t pad8(int64_t n) { return (n + 7) / 8 * 8; }

// Element i of a float16 or float32 array, as float (float16 -> float is exact).
inline float param(const void* p, bool half, int64_t i) {
  if (!half) return static_cast<const float*>(p)[i];
#if defined(__F16C__)
  return _cvtsh_ss(static_cast<const c10::Half*>(p)[i].x);
#else
  return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
#endif
}

// n values from offset off as float into out.
inline void to_float(const void* p, bool half, int64_t off, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  if (half)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(static_cast<const c10::Half*>(p) + off + i))));
#endif
  for (; i < n; ++i) out[i] = param(p, half, off + i);
}

// Elements per scale slot: a 32-block, or a 16-half where groups do not cover whole blocks
// (G = 16: GGUF's Q6_K; G = 48, ...). A slot lies in one group.
inline int64_t slot_size(int64_t G) { return G % QK == 0 ? QK : 16; }

// x quantized: q [M, K] int16, dx [M, nb] per 32-block, gs [M, ngp] the sum of x over each group
// (biased formats; zero padded to whole 8-lane vectors).
struct QActs {
  std::vector<int16_t> q;
  std::vector<float> dx, gs;
  int64_t nb = 0, ngp = 0;
};

void quantize_row(const float* xr, const QW& w, bool sums, int16_t* qr, float* dr, float* gr) {
  const int64_t K = w.K, nb = K / QK, G = w.G;
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
    const float d = amax / 32767.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    dr[b] = d;
#if defined(__AVX2__)
    const __m256 idv = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], idv));  // round to nearest even
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], idv));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], idv));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], idv));
    // packs works per 128-bit lane: 0-3 8-11 4-7 12-15, put back in order
    i0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
    i2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + b * QK), i0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + b * QK + 16), i2);
#else
    for (int64_t i = 0; i < QK; ++i)
      qr[b * QK + i] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(xb[i] * id))));
#endif
  }
  if (!sums) return;
  for (int64_t g = 0; g < w.ng; ++g) {  // G is a multiple of 16: whole 8-lane vectors
    const float* xg = xr + g * G;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < G; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(xg + i));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    gr[g] = _mm_cvtss_f32(s);
#else
    float s = 0.f;
    for (int64_t i = 0; i < G; ++i) s += xg[i];
    gr[g] = s;
#endif
  }
}

void quantize_rows(const float* x, int64_t ldx, int64_t M, const QW& w, bool sums, QActs& a) {
  a.nb = w.K / QK;
  a.ngp = pad8(w.ng);
  a.q.resize(M * w.K);
  a.dx.resize(M * a.nb);
  if (sums) a.gs.assign(M * a.ngp, 0.f);
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / w.K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * ldx, w, sums, a.q.data() + m * w.K, a.dx.data() + m * a.nb,
                   sums ? a.gs.data() + m * a.ngp : nullptr);
  });
}

// What a tile reads for its columns: wq[c] column c's codes; either sc [C][lds] the scale of
// each slot as float (the tile multiplies it by dx), or d [R][C][lds] (row stride ldr) those
// products already made (the same float products: one multiply either way); bi [C][ngp] the
// biases as float (zero padded) or nullptr.
struct ColTab {
  const uint8_t* wq[8];
  const uint8_t* pf;  // the next tile's codes, prefetched pstep bytes a block
  int64_t pstep;
  const float* sc;
  const float* d;
  int64_t lds, ldr;
  const float* bi;
};

#if defined(__AVX2__)
// The block's codes as two vectors of 16 int16: elements 0-15 and 16-31. A 4-bit chunk's byte j
// holds element j (low nibble) and j + 16 (high nibble): widened to 16 bits, the mask and the
// shift split them.
template <int BITS>
inline void block_codes(const uint8_t* p, __m256i& lo, __m256i& hi) {
  if (BITS == 4) {
    const __m256i w16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_and_si256(w16, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(w16, 4);
  } else {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
}

// R rows x C columns (C = 8 only for one row). Element (r, c): acc = 0; per block b in order
// acc = fma(float(isum_b), scale_b * dx_b, acc) (isum_b: 8 lanes, lane l the integer sum of
// elements 2l, 2l+1, 16+2l, 17+2l; S16: the two 16-slots' halves each with its own scale, the
// first half's FMA first); then per 8 groups
// acc = fma(bias, gs, acc); then the lanes summed as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
// Nothing in this depends on R, C, PRE or on which columns share the tile.
template <int BITS, bool S16, int R, int C, bool PRE>
void tile(const ColTab& t, const int16_t* xq, const float* dx, const float* gs, const QActs& a, int64_t K,
          float* y, int64_t ldy, int64_t ncols) {
  static_assert(C == 4 || (C == 8 && R == 1), "tile shapes");
  const int64_t nb = K / QK, ldx = K, ldd = a.nb, ngp = a.ngp, lds = t.lds, ldr = t.ldr;
  // accumulators: row r, column c (named: arrays of vectors end up on the stack)
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a04 = a00, a05 = a00, a06 = a00, a07 = a00,
         a10 = a00, a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
  const float* tab = PRE ? t.d : t.sc;
  for (int64_t b = 0; b < nb; ++b) {
    // the hardware prefetcher follows a few interleaved column streams poorly from DRAM
    for (int64_t o = 0; o < t.pstep; o += 64) _mm_prefetch(reinterpret_cast<const char*>(t.pf + b * t.pstep + o), _MM_HINT_T0);
#define QG_DV(r, c, k, SV) \
  (PRE ? _mm256_broadcast_ss(tab + r * ldr + c * lds + k) : _mm256_mul_ps(SV, _mm256_broadcast_ss(dx + r * ldd + b)))
#define QG_RC(r, c, A)                                                                                \
  if (R > r) {                                                                                        \
    const int16_t* xb = xq + r * ldx + b * QK;                                                        \
    /* s16 x s16 pairs -> s32 (|q| <= 128, |x| <= 32767: no overflow) */                              \
    const __m256i plo = _mm256_madd_epi16(wlo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));      \
    const __m256i phi = _mm256_madd_epi16(whi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))); \
    if (S16) {                                                                                        \
      A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(plo), QG_DV(r, c, 2 * b, sv0), A);                       \
      A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(phi), QG_DV(r, c, 2 * b + 1, sv1), A);                   \
    } else {                                                                                          \
      A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(plo, phi)), QG_DV(r, c, b, sv0), A);    \
    }                                                                                                 \
  }
#define QG_COL(c, A0, A1, A2)                                                                         \
  if (C > c) {                                                                                        \
    __m256i wlo, whi;                                                                                 \
    block_codes<BITS>(t.wq[c] + b * (BITS == 4 ? QK / 2 : QK), wlo, whi);                             \
    const __m256 sv0 = PRE ? _mm256_setzero_ps() : _mm256_broadcast_ss(tab + c * lds + (S16 ? 2 * b : b)); \
    const __m256 sv1 = PRE || !S16 ? sv0 : _mm256_broadcast_ss(tab + c * lds + 2 * b + 1);            \
    QG_RC(0, c, A0) QG_RC(1, c, A1) QG_RC(2, c, A2)                                                   \
  }
    QG_COL(0, a00, a10, a20)
    QG_COL(1, a01, a11, a21)
    QG_COL(2, a02, a12, a22)
    QG_COL(3, a03, a13, a23)
    QG_COL(4, a04, a10, a20)  // (C = 8: one row)
    QG_COL(5, a05, a11, a21)
    QG_COL(6, a06, a12, a22)
    QG_COL(7, a07, a13, a23)
#undef QG_COL
#undef QG_RC
#undef QG_DV
  }
  if (t.bi != nullptr)
    for (int64_t g = 0; g < ngp; g += 8) {
#define QG_BIAS(c, A0, A1, A2)                                                                        \
  if (C > c) {                                                                                        \
    const __m256 bv = _mm256_loadu_ps(t.bi + c * ngp + g);                                           \
    A0 = _mm256_fmadd_ps(bv, _mm256_loadu_ps(gs + g), A0);                                            \
    if (R > 1) A1 = _mm256_fmadd_ps(bv, _mm256_loadu_ps(gs + ngp + g), A1);                           \
    if (R > 2) A2 = _mm256_fmadd_ps(bv, _mm256_loadu_ps(gs + 2 * ngp + g), A2);                       \
  }
      QG_BIAS(0, a00, a10, a20) QG_BIAS(1, a01, a11, a21) QG_BIAS(2, a02, a12, a22) QG_BIAS(3, a03, a13, a23)
      QG_BIAS(4, a04, a10, a20) QG_BIAS(5, a05, a11, a21) QG_BIAS(6, a06, a12, a22) QG_BIAS(7, a07, a13, a23)
#undef QG_BIAS
    }
  // hadd pairs lanes (0,1) (2,3) within each 128-bit half, then those pairs; the halves last
  auto reduce4 = [](__m256 c0, __m256 c1, __m256 c2, __m256 c3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(c0, c1), _mm256_hadd_ps(c2, c3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  };
  __m128 v[4];
  v[0] = reduce4(a00, a01, a02, a03);
  if (C == 8) v[1] = reduce4(a04, a05, a06, a07);
  if (R > 1) v[1] = reduce4(a10, a11, a12, a13);
  if (R > 2) v[2] = reduce4(a20, a21, a22, a23);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < C / 4; ++h) {
      float* yo = y + r * ldy + 4 * h;
      const int64_t left = ncols - 4 * h;
      if (left >= 4) {
        _mm_storeu_ps(yo, v[r + h]);
      } else {
        float o[4];
        _mm_storeu_ps(o, v[r + h]);
        for (int64_t c = 0; c < left; ++c) yo[c] = o[c];
      }
    }
}
#else
// Portable version of the same computation, one element at a time.
template <int BITS, bool S16, int R, int C, bool PRE>
void tile(const ColTab& t, const int16_t* xq, const float* dx, const float* gs, const QActs& a, int64_t K,
          float* y, int64_t ldy, int64_t ncols) {
  const int64_t nb = K / QK, ngp = a.ngp;
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < std::min<int64_t>(ncols, C); ++c) {
      const uint8_t* wq = t.wq[c];
      float lanes[8] = {};
      auto code = [&](int64_t b, int e) -> int32_t {
        return BITS == 4 ? (e < 16 ? wq[b * 16 + e] & 0xF : wq[b * 16 + e - 16] >> 4)
                         : static_cast<int8_t>(wq[b * QK + e]);
      };
      auto dv = [&](int64_t b, int64_t j) {
        return PRE ? t.d[r * t.ldr + c * t.lds + j] : t.sc[c * t.lds + j] * dx[r * a.nb + b];
      };
      for (int64_t b = 0; b < nb; ++b) {
        const int16_t* xb = xq + r * K + b * QK;
        for (int l = 0; l < 8; ++l) {  // lane l: elements 2l, 2l+1 (first half) and 16+2l, 17+2l
          const int32_t lo = code(b, 2 * l) * xb[2 * l] + code(b, 2 * l + 1) * xb[2 * l + 1];
          const int32_t hi = code(b, 16 + 2 * l) * xb[16 + 2 * l] + code(b, 17 + 2 * l) * xb[17 + 2 * l];
          if (S16) {
            lanes[l] = std::fma(static_cast<float>(lo), dv(b, 2 * b), lanes[l]);
            lanes[l] = std::fma(static_cast<float>(hi), dv(b, 2 * b + 1), lanes[l]);
          } else {
            lanes[l] = std::fma(static_cast<float>(lo + hi), dv(b, b), lanes[l]);
          }
        }
      }
      if (t.bi != nullptr)
        for (int64_t g = 0; g < ngp; g += 8)
          for (int l = 0; l < 8; ++l) lanes[l] = std::fma(t.bi[c * ngp + g + l], gs[r * ngp + g + l], lanes[l]);
      y[r * ldy + c] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    }
}
#endif

using TileFn = void (*)(const ColTab&, const int16_t*, const float*, const float*, const QActs&, int64_t, float*,
                        int64_t, int64_t);
struct Tiles {
  TileFn pre[kRows + 1];  // [r]: r rows from the d table (calls of at most kRows rows)
  TileFn mul[kRows + 1];  // [r]: r rows, scale * dx in the tile
};
template <int BITS, bool S16>
Tiles tiles_for() {
  return Tiles{{nullptr, tile<BITS, S16, 1, 8, true>, tile<BITS, S16, 2, 4, true>, tile<BITS, S16, 3, 4, true>},
               {nullptr, tile<BITS, S16, 1, 4, false>, tile<BITS, S16, 2, 4, false>, tile<BITS, S16, 3, 4, false>}};
}

void qgemm_int(const float* x, int64_t ldx, int64_t M, const QW& w, int64_t N, float* y) {
  QActs a;
  const bool biased = w.b != nullptr;
  quantize_rows(x, ldx, M, w, biased, a);
  const int64_t K = w.K, slot = slot_size(w.G), nslot = K / slot, ng = w.ng, ngp = a.ngp, per = QK / slot;
  const Tiles tiles = w.bits == 4 ? tiles_for<4, false>() : slot == 16 ? tiles_for<8, true>() : tiles_for<8, false>();
  // Few rows (one tile): scale * dx made per column chunk, vectorized, rather than in the tile.
  const bool pre = M <= kRows;
  const int64_t cols = M == 1 ? 8 : kCols;  // columns per tile
  // Rows per chunk: their int16 x (2K bytes a row) stays in L2 while a column chunk passes over it.
  const int64_t mchunk = std::max<int64_t>(kRows, (131072 / K) / kRows * kRows);
  // Columns [n0, nend) (a multiple of 8 from n0) for rows [mb, me).
  auto work = [&](int64_t nbeg, int64_t nend, int64_t mb, int64_t me) {
    const int64_t lds = nslot;
    std::vector<float> sc(kChunkCols * lds), d(pre ? M * kChunkCols * lds : 0), bi(biased ? kChunkCols * ngp : 0, 0.f);
    // dx of each row repeated for every column of a chunk (the d table then is one flat product)
    std::vector<float> dxrep(pre && per == 1 ? M * kChunkCols * lds : 0);
    for (int64_t m = 0; m < static_cast<int64_t>(dxrep.size()) / (kChunkCols * lds); ++m)
      for (int64_t c = 0; c < kChunkCols; ++c)
        std::copy(a.dx.data() + m * a.nb, a.dx.data() + (m + 1) * a.nb, dxrep.data() + (m * kChunkCols + c) * lds);
    for (int64_t n0 = nbeg; n0 < nend; n0 += kChunkCols) {
      const int64_t n1 = std::min(nend, n0 + kChunkCols), len = (n1 - n0) * lds;
      // this chunk's scales per slot and biases, as float
      if (w.G == slot) to_float(w.s, w.s16, n0 * ng, len, sc.data());  // (lds == ng: one run)
      for (int64_t n = n0; n < n1; ++n) {
        float* s = sc.data() + (n - n0) * lds;
        if (w.G != slot)
          for (int64_t j = 0; j < nslot; ++j) s[j] = param(w.s, w.s16, n * ng + j * slot / w.G);
        if (biased) to_float(w.b, w.b16, n * ng, ng, bi.data() + (n - n0) * ngp);
      }
      if (pre)
        for (int64_t m = 0; m < M; ++m) {
          float* dr = d.data() + m * kChunkCols * lds;
          if (per == 1) {
            const float* xr = dxrep.data() + m * kChunkCols * lds;
            int64_t i = 0;
#if defined(__AVX2__)
            for (; i + 8 <= len; i += 8)
              _mm256_storeu_ps(dr + i, _mm256_mul_ps(_mm256_loadu_ps(sc.data() + i), _mm256_loadu_ps(xr + i)));
#endif
            for (; i < len; ++i) dr[i] = sc[i] * xr[i];
          } else {
            for (int64_t i = 0; i < len; ++i) dr[i] = sc[i] * a.dx[m * a.nb + (i % lds) / per];
          }
        }
      for (int64_t m0 = mb; m0 < me; m0 += mchunk) {
        const int64_t m1 = std::min(me, m0 + mchunk);
        const bool first = m0 == mb;  // the codes come from memory (then from the caches)
        for (int64_t c0 = n0; c0 < n1; c0 += cols) {
          const int64_t nc = std::min(cols, n1 - c0);
          ColTab t;
          // a tile past the last column repeats its codes; the tables' rows there hold finite
          // values (zeros or an earlier chunk's); those results are dropped
          for (int64_t c = 0; c < 8; ++c) t.wq[c] = w.q + (c0 + std::min(c, nc - 1)) * w.ldq;
          t.pf = w.q + (c0 + cols) * w.ldq;
          t.pstep = first ? (cols * w.ldq + K / QK - 1) / (K / QK) : 0;
          t.sc = sc.data() + (c0 - n0) * lds;
          t.d = pre ? d.data() + (c0 - n0) * lds : nullptr;
          t.lds = lds;
          t.ldr = kChunkCols * lds;
          t.bi = biased ? bi.data() + (c0 - n0) * ngp : nullptr;
          // tiles of at most kRows rows, as even as can be (more accumulators per tile)
          const int64_t passes = (m1 - m0 + kRows - 1) / kRows;
          for (int64_t i = 0, m = m0; i < passes; ++i, t.pstep = 0) {
            const int64_t r = (m1 - m + (passes - i) - 1) / (passes - i);
            (pre ? tiles.pre : tiles.mul)[r](t, a.q.data() + m * K, a.dx.data() + m * a.nb,
                                             biased ? a.gs.data() + m * ngp : nullptr, a, K, y + m * N + c0, N, nc);
            m += r;
          }
        }
      }
    }
  };
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  if (M >= 16 * nt) {
    // Many rows: each thread takes a contiguous range of rows (its own share of x in its caches)
    // and every column.
    const int64_t ms = (M + nt - 1) / nt;
    at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t i = t0; i < t1; ++i)
        if (i * ms < M) work(0, N, i * ms, std::min(M, (i + 1) * ms));
    });
  } else {
    // Few rows: one contiguous range of 8-column units per thread.
    const int64_t nunits = (N + 7) / 8;
    at::parallel_for(0, nunits, (nunits + nt - 1) / nt,
                     [&](int64_t u0, int64_t u1) { work(u0 * 8, std::min(N, u1 * 8), 0, M); });
  }
}

}  // namespace


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
  qgemm_int(x.data_ptr<float>(), x.stride(0), M, w, n, y.data_ptr<float>());
  return y;
}
