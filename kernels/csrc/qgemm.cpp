// Quantized linear: y [M, N] = x [M, K] @ dequantize(W)^T with W in the engine's block format
// (kernels/quant.py): 4-bit nibble chunks in GGUF's Q4 layout or int8 codes, one scale and an
// optional bias per group of G elements of a row, value = scale * q + bias.
//
// One algorithm for every M. Each row of x is quantized to int16 per 32-element block (dx =
// max|x| / 32767: a relative error near 1e-5, so greedy tokens follow the float model's, where int8
// activations flip near-ties); exact integer dot products of x and the codes give per block a few
// lanes of partial sums, and acc += float(isum) * (scale * dx) per block (one FMA chain per output
// element over the blocks in order); a group's bias multiplies the float sum of x over the group
// (FMAs into the same accumulator after the blocks); the lanes are summed in one fixed tree. An
// output element is computed by exactly this instruction sequence whatever M, the other rows and
// the tiling: a row alone gives the same bits as inside any batch.
// AVX2: madd_epi16 on the codes widened to 16 bits, 8 lanes of 4-element sums per block (tile()).
// Tiles are 4 columns x up to 3 rows (8 columns for a single row: more independent FMA chains).
// AVX-512 (BW, VL, VNNI, VBMI; QG_512): x is stored in an order that puts several blocks in one
// 16-lane vector of integer sums, so one cvt + mul + FMA serves several blocks: 4-bit codes 4
// blocks a vector, one block per 128-bit lane, the nibbles widened in-lane (tile4l()); 8-bit codes
// groups of 4 and 2 blocks, the bytes put in x's order by vpermb (tile512()). The lanes of
// each accumulator are added in halves (l + 8 into l) before the AVX2 path's tree. Tiles are 4
// columns x up to 4 rows (8 columns for a single row). The bits differ from the AVX2 path's.
// Both: the x block and dx loads are shared by the tile's columns, a weight block is unpacked once
// for all its rows, and the lanes of 4 columns are summed by one hadd tree. Each thread takes one
// contiguous range of columns (few rows) or of rows (many); within it columns go in chunks
// (their scales as float tables; AVX2, for calls of at most 3 rows, the products scale * dx too)
// and rows in chunks whose int16 x stays in L2. The first row tile of each column tile prefetches
// the next column tile's codes.
#include "common.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define QG_512 1
#else
#define QG_512 0
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
  int64_t nb = 0, ngp = 0, ldq = 0;  // blocks per row (QG_512: padded), gs's row, q's row
  int64_t ldd = 0;  // dx's row: nb, or 4 nb in the lane layout (each block's dx 4 times)
  bool lanes = false;  // QG_512, 4-bit: the lane layout
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

#if QG_512
// With 8-bit codes the 512-bit path takes a row's blocks in groups of g = 4, then 2 (the last
// padded with a zero block when the count is odd; 8-blocks measured slower: their codes cost more
// shuffles than the float work they save): a group's integer sums fill one 16-lane vector, lane
// i g + b (i < 16 / g) for block b of the group.
inline int64_t padded_blocks(int64_t nb) { return (nb + 1) / 2 * 2; }
// The size of the group that starts at block b0 of a row of nb blocks.
inline int64_t group_size_at(int64_t b0, int64_t nb) {
  return b0 < nb / 4 * 4 ? 4 : 2;
}
// The first block of the group that holds block blk.
inline int64_t group_start(int64_t blk, int64_t nb) {
  const int64_t p0 = nb / 4 * 4;
  return blk < p0 ? blk / 4 * 4 : p0 + (blk - p0) / 2 * 2;
}
// A row's int16 x rearranged for the groups: group (b0, g) holds g vectors of 32 int16 at
// 32 b0, vector q holding at int16 lane 2 (i g + b) + t element 2 (16 / g q + i) + t of block
// b0 + b: after madd/dpwssd, 32-bit lane i g + b belongs to block b0 + b.
void to_groups(const int16_t* src, int64_t nb, int16_t* dst) {
  const int64_t nbp = padded_blocks(nb);
  for (int64_t b0 = 0, g; b0 < nbp; b0 += g) {
    g = group_size_at(b0, nb);
    for (int64_t b = 0; b < g && b0 + b < nb; ++b)
      for (int64_t j = 0; j < 16; ++j)
        std::memcpy(dst + 2 * (16 * b0 + 16 * (j / (16 / g)) + (j % (16 / g)) * g + b), src + (b0 + b) * QK + 2 * j, 4);
  }
}
// A row's int16 x in the lane layout (4-bit codes): per 4 blocks (zero blocks pad the last) 4
// vectors of 32 int16, vector q holding in its 128-bit lane b elements 8 q to 8 q + 7 of block b.
void to_lanes(const int16_t* src, int64_t nb, int16_t* dst) {
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t q = 0; q < 4; ++q) std::memcpy(dst + (b / 4) * 128 + q * 32 + (b % 4) * 8, src + b * QK + 8 * q, 16);
}
#endif

void quantize_rows(const float* x, int64_t ldx, int64_t M, const QW& w, bool sums, QActs& a) {
  const int64_t nb = w.K / QK;
#if QG_512
  a.lanes = w.bits == 4;
  a.nb = a.lanes ? (nb + 3) / 4 * 4 : padded_blocks(nb);
  a.ldd = a.lanes ? 4 * a.nb : a.nb;
  a.ngp = (w.ng + 15) / 16 * 16;
  a.ldq = a.nb * QK;
  a.q.assign(M * a.ldq, 0);
  a.dx.assign(M * a.ldd, 0.f);
#else
  a.nb = nb;
  a.ldd = nb;
  a.ngp = pad8(w.ng);
  a.ldq = w.K;
  a.q.resize(M * w.K);
  a.dx.resize(M * a.nb);
#endif
  if (sums) a.gs.assign(M * a.ngp, 0.f);
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / w.K), [&](int64_t m0, int64_t m1) {
#if QG_512
    std::vector<int16_t> tmp(w.K);
    std::vector<float> dtmp(nb);
#endif
    for (int64_t m = m0; m < m1; ++m) {
#if QG_512
      int16_t* qr = tmp.data();  // then rearranged
      float* dr = a.lanes ? dtmp.data() : a.dx.data() + m * a.ldd;
#else
      int16_t* qr = a.q.data() + m * a.ldq;
      float* dr = a.dx.data() + m * a.ldd;
#endif
      quantize_row(x + m * ldx, w, sums, qr, dr, sums ? a.gs.data() + m * a.ngp : nullptr);
#if QG_512
      if (a.lanes) {
        to_lanes(qr, nb, a.q.data() + m * a.ldq);
        for (int64_t b = 0; b < nb; ++b) std::fill_n(a.dx.data() + m * a.ldd + 4 * b, 4, dr[b]);
      } else {
        to_groups(qr, nb, a.q.data() + m * a.ldq);
      }
#endif
    }
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

#if QG_512
// vpermb tables putting a group's 8-bit code bytes (element e of block b: byte 32 b + e) in the
// order of the group layout of x: byte 2 (i g + b) + t of vector q of the group.
struct GroupIdx {
  alignas(64) uint8_t g2[64];  // g = 2: [32 q + 2 (2 i + b) + t]
  alignas(64) uint8_t g4[64];  // g = 4: [32 q + 2 (4 i + b) + t], q = 0-1; + 16: q = 2-3
  GroupIdx() {
    for (int t = 0; t < 2; ++t)
      for (int s = 0; s < 2; ++s) {
        for (int i = 0; i < 8; ++i)
          for (int b = 0; b < 2; ++b)
            g2[32 * s + 2 * (2 * i + b) + t] = static_cast<uint8_t>(32 * b + 16 * s + 2 * i + t);
        for (int i = 0; i < 4; ++i)
          for (int b = 0; b < 4; ++b)
            g4[32 * s + 2 * (4 * i + b) + t] = static_cast<uint8_t>(32 * b + 8 * s + 2 * i + t);
      }
  }
};
const GroupIdx kGroupIdx;

inline __m512i ld_idx(const uint8_t* p) { return _mm512_load_si512(p); }
inline __m512i slo16(__m512i v) { return _mm512_cvtepi8_epi16(_mm512_castsi512_si256(v)); }
inline __m512i shi16(__m512i v) { return _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1)); }

// A group's 8-bit codes as G vectors of 32 int16 in the group layout of x (z[q] lane
// 2 (i G + b) + t: element 2 (16 / G q + i) + t of block b). Only a pair may be short: its
// second block reads as zero codes when nvalid = 1.
template <int G>
inline void group_codes(const uint8_t* p, int64_t nvalid, __m512i* z) {
  if (G == 2) {
    const __m512i raw = _mm512_maskz_loadu_epi8(nvalid == 2 ? ~0ULL : 0xFFFFFFFFULL, p);
    const __m512i perm = _mm512_permutexvar_epi8(ld_idx(kGroupIdx.g2), raw);
    z[0] = slo16(perm);
    z[1] = shi16(perm);
  } else {
    const __m512i r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + 64), idx = ld_idx(kGroupIdx.g4);
    const __m512i p01 = _mm512_permutex2var_epi8(r0, idx, r1);
    const __m512i p23 = _mm512_permutex2var_epi8(r0, _mm512_add_epi8(idx, _mm512_set1_epi8(16)), r1);
    z[0] = slo16(p01);
    z[1] = shi16(p01);
    z[2] = slo16(p23);
    z[3] = shi16(p23);
  }
}

// G floats from p, lane i G + b holding p[b].
template <int G>
inline __m512 bcast(const float* p) {
  if (G == 4) return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
  double d;
  std::memcpy(&d, p, 8);
  return _mm512_castpd_ps(_mm512_set1_pd(d));
}

// One group of G blocks from b0 for the tile's R x C elements (see tile512).
template <bool S16, int R, int C, int G>
__attribute__((always_inline)) inline void group_step(__m512 (&acc)[R][C], const ColTab& t, const int16_t* xq,
                                                      int64_t ldx, const float* dx, int64_t ldd, int64_t b0,
                                                      int64_t nvalid) {
  for (int64_t o = 0; o < G * t.pstep; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(t.pf + b0 * t.pstep + o), _MM_HINT_T0);
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    __m512i z[G];
    group_codes<G>(t.wq[c] + b0 * QK, nvalid, z);
    const float* sc = t.sc + c * t.lds + (S16 ? 2 : 1) * b0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int16_t* xb = xq + r * ldx + QK * b0;
      const __m512 dv = bcast<G>(dx + r * ldd + b0);
      // s16 x s16 pairs -> s32: at most 8 products |q| <= 128, |x| <= 32767 per lane, no overflow
      __m512i i0 = _mm512_madd_epi16(z[0], _mm512_loadu_si512(xb));
      if (S16) {
        for (int q = 1; q < G / 2; ++q) i0 = _mm512_dpwssd_epi32(i0, z[q], _mm512_loadu_si512(xb + 32 * q));
        __m512i i1 = _mm512_madd_epi16(z[G / 2], _mm512_loadu_si512(xb + 16 * G));
        for (int q = G / 2 + 1; q < G; ++q) i1 = _mm512_dpwssd_epi32(i1, z[q], _mm512_loadu_si512(xb + 32 * q));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(bcast<G>(sc), dv), acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(bcast<G>(sc + G), dv), acc[r][c]);
      } else {
        for (int q = 1; q < G; ++q) i0 = _mm512_dpwssd_epi32(i0, z[q], _mm512_loadu_si512(xb + 32 * q));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(bcast<G>(sc), dv), acc[r][c]);
      }
    }
  }
}

// The lanes of each accumulator summed (l + 8 into l, then the 8 by hadd trees of 4 columns)
// into y.
template <int R, int C>
inline void store512(__m512 (&acc)[R][C], float* y, int64_t ldy, int64_t ncols) {
  auto half = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  auto reduce4 = [&](const __m512* v) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(v[0]), half(v[1])), _mm256_hadd_ps(half(v[2]), half(v[3])));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  };
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < C / 4; ++h) {
      const __m128 v = reduce4(&acc[r][4 * h]);
      float* yo = y + r * ldy + 4 * h;
      const int64_t left = ncols - 4 * h;
      if (left >= 4) {
        _mm_storeu_ps(yo, v);
      } else {
        float o[4];
        _mm_storeu_ps(o, v);
        for (int64_t c = 0; c < left; ++c) yo[c] = o[c];
      }
    }
}

// Per 16 groups, acc = fma(bias, gs, acc) for every column's biases (if any), then store512.
template <int R, int C>
inline void bias_and_store512(__m512 (&acc)[R][C], const ColTab& t, const float* gs, int64_t ngp, float* y,
                              int64_t ldy, int64_t ncols) {
  if (t.bi != nullptr)
    for (int64_t g = 0; g < ngp; g += 16)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m512 bv = _mm512_loadu_ps(t.bi + c * ngp + g);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(bv, _mm512_loadu_ps(gs + r * ngp + g), acc[r][c]);
      }
  store512<R, C>(acc, y, ldy, ncols);
}

// 8-bit codes, R rows x C columns over a row's groups of blocks (x in the group layout; each
// column's scales per block in order, or for S16 per group at 2 b0 + h g + b for half h of block
// b0 + b).
// Element (r, c): acc = 0 (16 lanes); per group in order: isum = the sum over its g vectors of
// x * codes by vpmaddwd / vpdpwssd (exact integers; lane i g + b: block b0 + b), then
// acc = fma(float(isum), scale * dx, acc) with lane i g + b's scale and dx those of block b0 + b
// (S16: the halves' partial sums, vectors below g / 2 then the rest, each its own FMA with its
// own scale, the first half's first); then per 16 groups acc = fma(bias, gs, acc); then lanes l
// and l + 8 added, and those 8 summed as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). The groups depend
// on K alone; nothing depends on R, C or the other columns.
template <bool S16, int R, int C>
void tile512(const ColTab& t, const int16_t* xq, const float* dx, const float* gs, const QActs& a, int64_t K,
             float* y, int64_t ldy, int64_t ncols) {
  static_assert(C == 4 || C == 8, "tile shapes");
  const int64_t nb = K / QK, ldx = a.ldq, ldd = a.nb, ngp = a.ngp;
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t b0 = 0;
  for (; b0 < nb / 4 * 4; b0 += 4) group_step<S16, R, C, 4>(acc, t, xq, ldx, dx, ldd, b0, 4);
  for (; b0 < nb; b0 += 2) group_step<S16, R, C, 2>(acc, t, xq, ldx, dx, ldd, b0, std::min<int64_t>(2, nb - b0));
  bias_and_store512<R, C>(acc, t, gs, ngp, y, ldy, ncols);
}
#endif

#if QG_512
// 4-bit codes in the lane layout, R rows x C columns (x as to_lanes; dx per block 4 times, each
// column's scales per block, zero padded to whole 4-block groups). Element (r, c): acc = 0 (16
// lanes); per 4 blocks in order: isum = the sum over vectors q = 0-3 of x * codes by vpmaddwd /
// vpdpwssd (exact integers; lane 4 b + i: block b's elements 8 q + 2 i and 8 q + 2 i + 1), then
// acc = fma(float(isum), scale * dx, acc) with lane 4 b + i's scale and dx those of block b (a
// last group of at most 2 blocks: lanes 0-7 only, by 256-bit ops, the others left as they are);
// then per 16 groups acc = fma(bias, gs, acc); then lanes l and l + 8 added, and those 8 summed
// as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). The groups depend on K alone; nothing depends on R, C
// or the other columns.
template <int R, int C>
void tile4l(const ColTab& t, const int16_t* xq, const float* dx, const float* gs, const QActs& a, int64_t K, float* y,
            int64_t ldy, int64_t ncols) {
  static_assert(C == 4 || C == 8, "tile shapes");
  const int64_t nb = K / QK, nq = a.nb / 4, ldx = a.ldq, ldd = a.ldd, ngp = a.ngp, lds = t.lds;
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  const __m512i rep4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // lane 4 b + i: b
  const int64_t pq = 4 * t.pstep;
  for (int64_t g = 0; g < nq; ++g) {
    for (int64_t o = 0; o < pq; o += 64) _mm_prefetch(reinterpret_cast<const char*>(t.pf + g * pq + o), _MM_HINT_T0);
    const int64_t nvalid = std::min<int64_t>(4, nb - 4 * g);
    if (nvalid <= 2) {  // a last group of at most 2 blocks: the same sums on the lower halves only
      const __m256i m4h = _mm256_set1_epi8(0x0F), zh = _mm256_setzero_si256();
      const __m256i rep4h = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m256i raw = _mm256_maskz_loadu_epi8(nvalid == 2 ? 0xFFFFFFFFU : 0xFFFFU, t.wq[c] + g * 64);
        const __m256i lo = _mm256_and_si256(raw, m4h), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4h);
        const __m256i z0 = _mm256_unpacklo_epi8(lo, zh), z1 = _mm256_unpackhi_epi8(lo, zh);
        const __m256i z2 = _mm256_unpacklo_epi8(hi, zh), z3 = _mm256_unpackhi_epi8(hi, zh);
        const __m256 sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(t.sc + c * lds + 4 * g)), rep4h);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int16_t* xb = xq + r * ldx + 128 * g;
          __m256i i0 = _mm256_madd_epi16(z0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
          i0 = _mm256_dpwssd_epi32(i0, z1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32)));
          i0 = _mm256_dpwssd_epi32(i0, z2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 64)));
          i0 = _mm256_dpwssd_epi32(i0, z3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 96)));
          const __m256 d = _mm256_mul_ps(sv, _mm256_loadu_ps(dx + r * ldd + 16 * g));
          acc[r][c] = _mm512_mask3_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(i0)), _mm512_zextps256_ps512(d),
                                            acc[r][c], 0x00FF);
        }
      }
      continue;
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const uint8_t* p = t.wq[c] + g * 64;  // block b's 16 bytes in 128-bit lane b
      const __m512i raw = nvalid == 4 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ULL << (16 * nvalid)) - 1, p);
      const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      const __m512i z0 = _mm512_unpacklo_epi8(lo, zero), z1 = _mm512_unpackhi_epi8(lo, zero);
      const __m512i z2 = _mm512_unpacklo_epi8(hi, zero), z3 = _mm512_unpackhi_epi8(hi, zero);
      const __m512 sv = _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(_mm_loadu_ps(t.sc + c * lds + 4 * g)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int16_t* xb = xq + r * ldx + 128 * g;
        // s16 x s16 pairs -> s32: |sum| <= 8 * 15 * 32767 per lane, no overflow
        __m512i i0 = _mm512_madd_epi16(z0, _mm512_loadu_si512(xb));
        i0 = _mm512_dpwssd_epi32(i0, z1, _mm512_loadu_si512(xb + 32));
        i0 = _mm512_dpwssd_epi32(i0, z2, _mm512_loadu_si512(xb + 64));
        i0 = _mm512_dpwssd_epi32(i0, z3, _mm512_loadu_si512(xb + 96));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(sv, _mm512_loadu_ps(dx + r * ldd + 16 * g)),
                                    acc[r][c]);
      }
    }
  }
  bias_and_store512<R, C>(acc, t, gs, ngp, y, ldy, ncols);
}
#endif

using TileFn = void (*)(const ColTab&, const int16_t*, const float*, const float*, const QActs&, int64_t, float*,
                        int64_t, int64_t);
#if QG_512
constexpr int64_t kTileRows = 4;  // 4 x 4 zmm accumulators (more rows measured no faster)
#else
constexpr int64_t kTileRows = kRows;
#endif
struct Tiles {
  TileFn pre[kTileRows + 1];  // [r]: r rows from the d table (AVX2, calls of at most kRows rows)
  TileFn mul[kTileRows + 1];  // [r]: r rows, scale * dx in the tile (QG_512: [0] one row, 8 columns)
};
template <int BITS, bool S16>
Tiles tiles_for() {
#if QG_512
  if (BITS == 4) return Tiles{{}, {tile4l<1, 8>, tile4l<1, 4>, tile4l<2, 4>, tile4l<3, 4>, tile4l<4, 4>}};
  return Tiles{{},
               {tile512<S16, 1, 8>, tile512<S16, 1, 4>, tile512<S16, 2, 4>, tile512<S16, 3, 4>, tile512<S16, 4, 4>}};
#else
  return Tiles{{nullptr, tile<BITS, S16, 1, 8, true>, tile<BITS, S16, 2, 4, true>, tile<BITS, S16, 3, 4, true>},
               {nullptr, tile<BITS, S16, 1, 4, false>, tile<BITS, S16, 2, 4, false>, tile<BITS, S16, 3, 4, false>}};
#endif
}

void qgemm_int(const float* x, int64_t ldx, int64_t M, const QW& w, int64_t N, float* y) {
  QActs a;
  const bool biased = w.b != nullptr;
  quantize_rows(x, ldx, M, w, biased, a);
  const int64_t K = w.K, slot = slot_size(w.G), nslot = K / slot, ng = w.ng, ngp = a.ngp, per = QK / slot;
  // scale slots per column in the tables (QG_512: whole pairs; S16 in group order)
  const int64_t lds = QG_512 ? per * a.nb : nslot;
  const Tiles tiles = w.bits == 4 ? tiles_for<4, false>() : slot == 16 ? tiles_for<8, true>() : tiles_for<8, false>();
  // Few rows (one tile): scale * dx made per column chunk, vectorized, rather than in the tile.
  const bool pre = !QG_512 && M <= kRows;
  const int64_t cols = M == 1 ? 8 : kCols;  // columns per tile
  // Rows per chunk: their int16 x (2K bytes a row) stays in L2 while a column chunk passes over it.
  const int64_t mchunk = std::max<int64_t>(kTileRows, (131072 / K) / kTileRows * kTileRows);
  // Columns [n0, nend) (a multiple of 8 from n0) for rows [mb, me).
  auto work = [&](int64_t nbeg, int64_t nend, int64_t mb, int64_t me) {
    std::vector<float> sc(kChunkCols * lds, 0.f), d(pre ? M * kChunkCols * lds : 0);
    std::vector<float> bi(biased ? kChunkCols * ngp : 0, 0.f);
    // dx of each row repeated for every column of a chunk (the d table then is one flat product)
    std::vector<float> dxrep(pre && per == 1 ? M * kChunkCols * lds : 0);
    for (int64_t m = 0; m < static_cast<int64_t>(dxrep.size()) / (kChunkCols * lds); ++m)
      for (int64_t c = 0; c < kChunkCols; ++c)
        std::copy(a.dx.data() + m * a.nb, a.dx.data() + (m + 1) * a.nb, dxrep.data() + (m * kChunkCols + c) * lds);
    for (int64_t n0 = nbeg; n0 < nend; n0 += kChunkCols) {
      const int64_t n1 = std::min(nend, n0 + kChunkCols), len = (n1 - n0) * lds;
      // this chunk's scales per slot and biases, as float
#if QG_512
      for (int64_t n = n0; n < n1; ++n) {
        float* s = sc.data() + (n - n0) * lds;
        if (w.G == slot && per == 1)
          to_float(w.s, w.s16, n * ng, ng, s);
        else  // slot j: half j % 2 of block j / 2, at 2 b0 + h g + b in its group (per = 2)
          for (int64_t j = 0; j < nslot; ++j) {
            const int64_t blk = j / per, b0 = group_start(blk, K / QK), g = group_size_at(b0, K / QK);
            s[per == 1 ? j : 2 * b0 + (j % 2) * g + blk - b0] = param(w.s, w.s16, n * ng + j * slot / w.G);
          }
#else
      if (w.G == slot) to_float(w.s, w.s16, n0 * ng, len, sc.data());  // (lds == ng: one run)
      for (int64_t n = n0; n < n1; ++n) {
        float* s = sc.data() + (n - n0) * lds;
        if (w.G != slot)
          for (int64_t j = 0; j < nslot; ++j) s[j] = param(w.s, w.s16, n * ng + j * slot / w.G);
#endif
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
          // tiles of at most kTileRows rows, as even as can be (more accumulators per tile)
          const int64_t passes = (m1 - m0 + kTileRows - 1) / kTileRows;
          for (int64_t i = 0, m = m0; i < passes; ++i, t.pstep = 0) {
            const int64_t r = (m1 - m + (passes - i) - 1) / (passes - i);
            const TileFn fn = (pre ? tiles.pre : tiles.mul)[QG_512 && cols == 8 ? 0 : r];
            fn(t, a.q.data() + m * a.ldq, a.dx.data() + m * a.ldd, biased ? a.gs.data() + m * ngp : nullptr, a, K,
               y + m * N + c0, N, nc);
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
