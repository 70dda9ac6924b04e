// The segmented LoRA update (SGMV) on the CPU: y[rows of segment g] += scaling * (x A^T) B per
// target of the projection, for segment g's adapter slot (kernels/lora.py states the contract and
// the layouts: A [slots, targets * R, K], B transposed [slots, R, N]).
// Two passes, each spread over every thread: shrink (h = scaling * x A^T: dot products over K,
// the A rows read once per block of rows) and expand (y += h B: an axpy over N per rank, with the
// B rows of a column chunk staying in L1 across the rows). Only the first rank rows of A and B
// are read, so small ranks cost what they are. AVX2/FMA where the build has it, else scalar.
#include "common.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace lora_cpu {

constexpr int64_t ROWS = 16;  // rows per task (a segment longer than this is split)
constexpr int64_t RCHUNK = 4;  // A rows (ranks) per shrink task
constexpr int64_t NCHUNK = 64;  // output columns per expand task

struct Block {
  int64_t m0, m1, slot;
};

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(bf16* p, __m256 v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int i = 0; i < 8; ++i) p[i] = bf16(tmp[i]);  // round to nearest even, as torch
}
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

// h[m, c] = sum_k x[m, k] a[c, k] for up to 4 rows of x against up to 2 rows of a.
template <typename T, int MR, int NR>
static inline void dots(const T* x, int64_t ldx, const T* a, int64_t lda, int64_t K, float* out, int64_t ldo) {
  float acc_s[MR][NR] = {};
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 av[NR];
    for (int r = 0; r < NR; ++r) av[r] = load8(a + r * lda + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = load8(x + m * ldx + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(xv, av[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc_s[m][r] = hsum(acc[m][r]);
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc_s[m][r] += tof(x[m * ldx + k]) * tof(a[r * lda + k]);
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = acc_s[m][r];
}

template <typename T, int MR>
static inline void dots_rows(const T* x, int64_t ldx, const T* a, int64_t lda, int64_t K, float* out, int64_t ldo,
                             int64_t nr) {
  for (int64_t r = 0; r < nr; r += 2) {
    if (nr - r >= 2)
      dots<T, MR, 2>(x, ldx, a + r * lda, lda, K, out + r, ldo);
    else
      dots<T, MR, 1>(x, ldx, a + r * lda, lda, K, out + r, ldo);
  }
}

// y[m, n0:n1] += sum_r h[m, r] b[r, n0:n1] for one row.
template <typename T>
static inline void axpys(T* y, const float* h, const T* b, int64_t ldb, int64_t rank, int64_t n0, int64_t n1) {
  int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; n + 16 <= n1; n += 16) {
    __m256 a0 = load8(y + n), a1 = load8(y + n + 8);
    __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 hv = _mm256_set1_ps(h[r]);
      d0 = _mm256_fmadd_ps(hv, load8(b + r * ldb + n), d0);
      d1 = _mm256_fmadd_ps(hv, load8(b + r * ldb + n + 8), d1);
    }
    store8(y + n, _mm256_add_ps(a0, d0));
    store8(y + n + 8, _mm256_add_ps(a1, d1));
  }
  for (; n + 8 <= n1; n += 8) {
    __m256 d = _mm256_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) d = _mm256_fmadd_ps(_mm256_set1_ps(h[r]), load8(b + r * ldb + n), d);
    store8(y + n, _mm256_add_ps(load8(y + n), d));
  }
#endif
  for (; n < n1; ++n) {
    float d = 0.f;
    for (int64_t r = 0; r < rank; ++r) d += h[r] * tof(b[r * ldb + n]);
    y[n] = fromf<T>(tof(y[n]) + d);
  }
}

template <typename T>
static void run(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                const std::vector<Block>& blocks, const int32_t* ranks, const float* scalings,
                const std::vector<int64_t>& offsets) {
  const int64_t T_rows = x.size(0), K = x.size(1), NT = (int64_t)offsets.size() - 1, R = b.size(1), N = b.size(2);
  const int64_t HW = NT * R;  // h's row: every target's ranks
  std::vector<float> h(T_rows * HW, 0.f);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  const int64_t nb = (int64_t)blocks.size(), rc = (R + RCHUNK - 1) / RCHUNK;
  // Shrink: tasks (block, target, rank chunk); chunks past a slot's rank return at once.
  at::parallel_for(0, nb * NT * rc, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Block& blk = blocks[t / (NT * rc)];
      const int64_t j = (t / rc) % NT, r0 = (t % rc) * RCHUNK;
      const int64_t rank = ranks[blk.slot * NT + j];
      if (r0 >= rank) continue;
      const int64_t nr = std::min(RCHUNK, rank - r0);
      const T* arows = ap + (blk.slot * HW + j * R + r0) * K;
      float* hb = h.data() + j * R + r0;
      int64_t m = blk.m0;
      for (; m + 4 <= blk.m1; m += 4) dots_rows<T, 4>(xp + m * ldx, ldx, arows, K, K, hb + m * HW, HW, nr);
      for (; m < blk.m1; ++m) dots_rows<T, 1>(xp + m * ldx, ldx, arows, K, K, hb + m * HW, HW, nr);
      const float sc = scalings[blk.slot * NT + j];
      for (int64_t mm = blk.m0; mm < blk.m1; ++mm)
        for (int64_t r = 0; r < nr; ++r) hb[mm * HW + r] *= sc;
    }
  });
  // Expand: tasks (block, column chunk); a chunk may span two targets' columns.
  const int64_t nc = (N + NCHUNK - 1) / NCHUNK;
  at::parallel_for(0, nb * nc, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Block& blk = blocks[t / nc];
      const int64_t c0 = (t % nc) * NCHUNK, c1 = std::min(N, c0 + NCHUNK);
      for (int64_t j = 0; j < NT; ++j) {
        const int64_t lo = std::max(c0, offsets[j]), hi = std::min(c1, offsets[j + 1]);
        const int64_t rank = ranks[blk.slot * NT + j];
        if (lo >= hi || rank == 0) continue;
        const T* brows = bp + blk.slot * R * N;
        for (int64_t m = blk.m0; m < blk.m1; ++m)
          axpys<T>(yp + m * ldy, h.data() + m * HW + j * R, brows, N, rank, lo, hi);
      }
    }
  });
}

}  // namespace lora_cpu

void lora_sgmv(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b,
               torch::Tensor seg_indptr, torch::Tensor weight_indices, torch::Tensor ranks, torch::Tensor scalings,
               torch::Tensor out_offsets) {
  using namespace lora_cpu;
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16, "lora_sgmv: float32 or bfloat16 x");
  TORCH_CHECK(y.scalar_type() == dt && lora_a.scalar_type() == dt && lora_b.scalar_type() == dt,
              "lora_sgmv: y, x, lora_a and lora_b must share a dtype");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3, "lora_sgmv: bad ranks");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_sgmv: x and y rows must be contiguous");
  TORCH_CHECK(lora_a.is_contiguous() && lora_b.is_contiguous(), "lora_sgmv: contiguous lora_a, lora_b");
  const int64_t S = lora_a.size(0), K = x.size(1), R = lora_b.size(1), N = lora_b.size(2);
  const int64_t NT = out_offsets.numel() - 1;
  TORCH_CHECK(NT >= 1 && lora_a.size(1) == NT * R && lora_a.size(2) == K && lora_b.size(0) == S,
              "lora_sgmv: lora_a [slots, targets * R, K] and lora_b [slots, R, N] do not match");
  TORCH_CHECK(y.size(0) == x.size(0) && y.size(1) == N, "lora_sgmv: y must be [T, N]");
  auto rk = ranks.to(torch::kInt32).contiguous();
  auto sc = scalings.to(torch::kFloat32).contiguous();
  TORCH_CHECK(rk.numel() == S * NT && sc.numel() == S * NT, "lora_sgmv: ranks and scalings [slots, targets]");
  auto ind = seg_indptr.to(torch::kInt64).contiguous();
  auto wi = weight_indices.to(torch::kInt64).contiguous();
  auto off = out_offsets.to(torch::kInt64).contiguous();
  const int64_t G = wi.numel();
  TORCH_CHECK(ind.numel() == G + 1, "lora_sgmv: seg_indptr has segments + 1 entries");
  const int64_t* indp = ind.data_ptr<int64_t>();
  const int64_t* wip = wi.data_ptr<int64_t>();
  const int32_t* rkp = rk.data_ptr<int32_t>();
  std::vector<int64_t> offsets(off.data_ptr<int64_t>(), off.data_ptr<int64_t>() + NT + 1);
  TORCH_CHECK(offsets[0] == 0 && offsets[NT] == N, "lora_sgmv: out_offsets must run from 0 to N");
  for (int64_t j = 0; j < NT; ++j) TORCH_CHECK(offsets[j] <= offsets[j + 1], "lora_sgmv: out_offsets decrease");
  std::vector<Block> blocks;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t s = wip[g], m0 = indp[g], m1 = indp[g + 1];
    TORCH_CHECK(0 <= m0 && m0 <= m1 && m1 <= x.size(0), "lora_sgmv: segment rows out of range");
    TORCH_CHECK(s < S, "lora_sgmv: slot ", s, " out of range");
    if (s < 0) continue;
    bool any = false;
    for (int64_t j = 0; j < NT; ++j) {
      TORCH_CHECK(0 <= rkp[s * NT + j] && rkp[s * NT + j] <= R, "lora_sgmv: a rank is outside [0, R]");
      any = any || rkp[s * NT + j] > 0;
    }
    if (!any) continue;
    for (int64_t m = m0; m < m1; m += ROWS) blocks.push_back({m, std::min(m1, m + ROWS), s});
  }
  if (blocks.empty()) return;
  if (dt == torch::kFloat32)
    run<float>(y, x, lora_a, lora_b, blocks, rkp, sc.data_ptr<float>(), offsets);
  else
    run<bf16>(y, x, lora_a, lora_b, blocks, rkp, sc.data_ptr<float>(), offsets);
}
