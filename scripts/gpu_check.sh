#!/usr/bin/env bash
# One prepared GPU check (no network needed; a few minutes on one GPU): the `gpu` tests (CUDA
# parity in bf16 and fp32, Triton kernels on the device, CUDA-graph replay vs eager, overlap and
# speculative verify batches on CUDA with n-gram and draft-model drafts, verify batches replayed as CUDA graphs, block-diffusion DLLM_EXTEND batches replayed as CUDA graphs, fused MoE,
# quantized weights through the Triton kernel, MoE experts kept quantized (grouped, no CUDA graphs), the HiCache host tier's pinned copies; CUDA graphs under TP=2 over NCCL, on a machine with two GPUs) and the graph / roofline and quantized-GEMM micro-benchmarks. Record its output in docs/BENCHMARKS.md.
#   bash scripts/gpu_check.sh [OUT_DIR]     (after `bash scripts/gpu_wheels.sh` here; carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
# Wheels that machine lacks (msgspec, pytest), fetched here by scripts/gpu_wheels.sh and carried.
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || exit 2
fi
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
# gpu-marked tests, then the kernel tests (on the device when CUDA is there); without pyproject's
# addopts, whose -n needs pytest-xdist (not carried).
timeout 240 python3 -m pytest -o addopts=-ra -q -m gpu tests/engine/test_gpu.py tests/engine/test_cuda_graph.py tests/engine/test_moe.py \
    tests/engine/test_quantized.py tests/engine/test_dllm_graphs.py tests/engine/test_hicache.py \
    tests/engine/test_tp_cuda_graphs.py \
    -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 120 python3 -m pytest -o addopts=-ra -q tests/kernels -p no:cacheprovider 2>&1 | tee -a "$out/gpu_tests.log"
tests_rc=$(( tests_rc || PIPESTATUS[0] ))
timeout 240 python3 -m engine.gpu_bench 2>&1 | tee "$out/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}
timeout 120 python3 -m kernels.triton_quant_bench 2>&1 | tee -a "$out/gpu_bench.log"
bench_rc=$(( bench_rc || PIPESTATUS[0] ))
echo "gpu_check: tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
