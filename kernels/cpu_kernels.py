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
- Linear layers over quantized weights kept in their block format (`qgemm`, kernels/quant.py's
  format): activations rounded to int16 per 32-element block and integer dot products against
  the codes (the weight read in its 4.5-9 bits per value), one algorithm for every row count: an
  output element's bits depend on its row and column only.
- The segmented LoRA update (`lora_sgmv`, kernels/lora.py): y += scaling * (x A^T) B per row's
  adapter slot, over stacked adapter buffers, AVX2/FMA (scalar where the build lacks it).
- RMSNorm with the residual add fused in (`add_rms_norm`), greedy argmax with the finiteness
  check (`argmax_rows`), and a streaming read of a buffer with every thread (`stream_sum`, for
  the memory-bandwidth figure of the benchmark).

Every kernel is also a torch operator (`torch.ops.radixray.*`, with fake implementations), so a
`torch.compile`d graph calls it as one opaque node. Numerics follow torch's: elementwise steps
round as torch's separate ops do (the build disables FMA contraction; the GEMM uses explicit
FMAs), bfloat16 results are rounded where torch rounds them.

The C++ lives in kernels/csrc/ (attention.cpp, gemm.cpp, qgemm.cpp, rowwise.cpp, lora.cpp, bindings.cpp,
common.h).
Built with torch.utils.cpp_extension (g++ and ninja needed) from a copy of the sources in a folder
keyed by their contents, the flags, torch version and CPU (so every checkout shares it); `load()` returns None when that is not possible and callers fall
back to torch. Set RADIXRAY_CPU_KERNELS=0 to disable it."""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import time

import torch

from kernels.cache import cache_dir

# The C++ sources, one file per concern (common.h: what they share), packaged with the module
# (pyproject.toml package-data). Each is a whole translation unit (C++ tooling reads it alone), but
# the build compiles them as one, a generated file that includes them all (a unity build, as
# CMake's): the torch headers are then parsed once, which halves the build on two cores.
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = ("attention.cpp", "gemm.cpp", "qgemm.cpp", "rowwise.cpp", "lora.cpp", "bindings.cpp")

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
    if "module" in _state:  # built (or failed) already: no lock on the per-call path
        return _state["module"]
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


def source_files(csrc: str | None = None) -> list[str]:
    """Every C++ file of the build (sources and headers) in `csrc` (default CSRC), sorted."""
    csrc = csrc or CSRC
    return sorted(os.path.join(csrc, f) for f in os.listdir(csrc) if f.endswith((".cpp", ".h")))


def build_digest(csrc: str | None = None) -> str:
    """The build folder's key: the C++ files (names and contents), flags, torch version and CPU;
    not where they are: every checkout, and every `ray job submit` working directory (a new
    path each job), shares one build of the same sources."""
    h = hashlib.sha256()
    for path in source_files(csrc):
        with open(path, "rb") as f:
            h.update(f"{os.path.basename(path)}\n".encode() + f.read() + b"\n")
    h.update("\n".join([" ".join(_FLAGS), torch.__version__, cpu_signature()]).encode())
    return h.hexdigest()[:12]


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
        from torch.utils.cpp_extension import load

        return load(name=f"radixray_cpu_kernels_{digest}", sources=[_unity_source(build_dir)],
                    extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=False)
    except Exception as e:  # no compiler, no ninja, ...: the torch path still works
        _state["error"] = f"{type(e).__name__}: {e}"
        return None


STAGED = "src"  # the build folder's copy of the sources (what the unity file includes)


def unity_text() -> str:
    """The one translation unit the build compiles: an #include of each source's copy in the build
    folder (compiler errors name the copy, whose lines are the source's)."""
    return "".join(f'#include "{STAGED}/{f}"\n' for f in SOURCES)


def _write_if_changed(path: str, data: bytes) -> None:
    """Rewritten only when it differs (a newer file would make ninja rebuild); atomically."""
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except OSError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _unity_source(build_dir: str) -> str:
    """Copy the sources into the build folder (keyed by their contents, so the copies are the
    same for every checkout) and write the unity file beside them."""
    os.makedirs(os.path.join(build_dir, STAGED), exist_ok=True)
    for src in source_files():
        with open(src, "rb") as f:
            _write_if_changed(os.path.join(build_dir, STAGED, os.path.basename(src)), f.read())
    path = os.path.join(build_dir, "cpu_kernels_unity.cpp")
    _write_if_changed(path, unity_text().encode())
    return path


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

    @torch.library.register_fake("radixray::qgemm")
    def _(x, qweight, scales, biases, bits, group_size, n):
        return x.new_empty(x.shape[0], n, dtype=torch.float32)

    @torch.library.register_fake("radixray::lora_sgmv")
    def _(y, x, lora_a, lora_b, seg_indptr, weight_indices, ranks, scalings, out_offsets):
        return None


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


def qgemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None, bits: int,
          group_size: int, n: int) -> torch.Tensor:
    """x [M, K] (float32, or converted to it) @ W^T over W in kernels/quant.py's block format:
    float32 [M, n]."""
    fn = torch.ops.radixray.qgemm if torch.compiler.is_compiling() else _eager("qgemm")
    return fn(x, qweight, scales, biases, bits, group_size, n)


def lora_sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              seg_indptr: torch.Tensor, weight_indices: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor,
              out_offsets: torch.Tensor) -> None:
    """y [T, N] += the segmented LoRA update of x [T, K] (kernels/lora.py's contract and layouts)."""
    fn = torch.ops.radixray.lora_sgmv if torch.compiler.is_compiling() else _eager("lora_sgmv")
    fn(y, x, lora_a, lora_b, seg_indptr, weight_indices, ranks, scalings, out_offsets)


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
