"""Paged decode attention for the CPU: reads K/V in place through req_to_token.

The torch path gathers every sequence's K and V into a padded tensor before SDPA, which on a
CPU costs more than the whole rest of a decode step at long contexts (the gather writes and
re-reads all of the KV). This kernel reads each K/V row once, where it lies in the pool, with
a two-pass softmax per (request, kv head) that serves every query head of the GQA group.

Built on first use with torch.utils.cpp_extension (g++ and ninja needed); `load()` returns
None when that is not possible and callers fall back to the torch path. Set
RADIXRAY_CPU_KERNELS=0 to disable it."""

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
#include <ATen/Parallel.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

// One work item: request b, kv heads [h0, h1). Every K/V row is read once, contiguously for
// the item's heads, and serves all G query heads of each kv head (GQA).
// DT > 0: head_dim known at compile time (unrolled, vectorised); DT == 0: any head_dim.
template <int64_t DT>
static void attend(const float* qb, const float* kp, const float* vp, float* ob, const int32_t* slots,
                   int64_t L, int64_t Hkv, int64_t G, int64_t h0, int64_t h1, float sc,
                   std::vector<float>& scores, int64_t Drt) {
  const int64_t D = DT > 0 ? DT : Drt;
  const int64_t nh = (h1 - h0) * G;  // query heads of this item
  scores.resize(nh * L);
  for (int64_t t = 0; t < L; ++t) {
    const float* krow = kp + static_cast<int64_t>(slots[t]) * Hkv * D;
    for (int64_t hk = h0; hk < h1; ++hk) {
      const float* k = krow + hk * D;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        const float* q = qb + h * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += q[d] * k[d];
        scores[(h - h0 * G) * L + t] = s * sc;
      }
    }
  }
  for (int64_t j = 0; j < nh; ++j) {
    float* row = scores.data() + j * L;
    float mx = -FLT_MAX, sum = 0.f;
    for (int64_t t = 0; t < L; ++t) mx = std::max(mx, row[t]);
    for (int64_t t = 0; t < L; ++t) { row[t] = std::exp(row[t] - mx); sum += row[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) row[t] *= inv;
  }
  for (int64_t h = h0 * G; h < h1 * G; ++h) std::fill(ob + h * D, ob + (h + 1) * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const float* vrow = vp + static_cast<int64_t>(slots[t]) * Hkv * D;
    for (int64_t hk = h0; hk < h1; ++hk) {
      const float* v = vrow + hk * D;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        const float p = scores[(h - h0 * G) * L + t];
        float* o = ob + h * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
      }
    }
  }
}

// q [B, H, D]; k_buf, v_buf [N, Hkv, D]; req_to_token int32 [R, C]; rows, seq_lens int64 [B].
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
  // Whole requests per item when there are enough of them (contiguous row reads); else split heads.
  const int64_t split = B >= 4 * at::get_num_threads() ? 1 : Hkv;
  at::parallel_for(0, B * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / split, part = i % split, L = lp[b];
      const int64_t h0 = part * Hkv / split, h1 = (part + 1) * Hkv / split;
      if (L <= 0) continue;
      const int32_t* slots = r2t + rp[b] * C;
      const float* qb = qp + b * H * D;
      float* ob = op + b * H * D;
      switch (D) {
        case 64: attend<64>(qb, kp, vp, ob, slots, L, Hkv, G, h0, h1, sc, scores, D); break;
        case 128: attend<128>(qb, kp, vp, ob, slots, L, Hkv, G, h0, h1, sc, scores, D); break;
        default: attend<0>(qb, kp, vp, ob, slots, L, Hkv, G, h0, h1, sc, scores, D);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU, float32)");
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
STALE_LOCK_S = 180
_lock = threading.Lock()
_state: dict[str, object] = {}


def load():
    """The compiled module, or None if disabled or it cannot be built here."""
    if os.environ.get("RADIXRAY_CPU_KERNELS", "1") == "0":
        return None
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


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
    build_dir = os.path.join(cache_dir(), "torch_extensions", f"cpu_attn_{digest}")
    os.makedirs(build_dir, exist_ok=True)
    # torch's build lock is a plain file: a process killed mid-build leaves it behind and every
    # later load would wait on it forever. A build takes well under a minute here.
    lock = os.path.join(build_dir, "lock")
    if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
        os.remove(lock)
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(name=f"radixray_cpu_attn_{digest}", cpp_sources=[_SOURCE], functions=None,
                           extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=False)
    except Exception as e:  # no compiler, no ninja, ...: the torch path still works
        _state["error"] = f"{type(e).__name__}: {e}"
        return None


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; attends over req_to_token[row, :seq_len] of each request."""
    return load().decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale)
