"""`python -m engine.bench --cases quant`: SmolLM2-135M-Instruct from its GGUF file with its weights
as F32 and BF16 (dequantized at load), Q4_1 (the file's own blocks, computed as quantized: its
tied embedding / LM head is Q8_0), and int8 / int4 (quantized at load from the dequantized F32:
int8 is Q8_0's scheme, int4 Q4_1's), side by side in one run: decode tok/s at batch 1, 8 and 32
(128-token prompts, 128 new tokens, best of two rounds), Q4_1 also with the CPU decode graphs, prefill tok/s, the weight bytes a decode
step reads and those bytes over the step time against this machine's measured read bandwidth.
With `--llama-cpp DIR` (a llama.cpp build: `llama-bench`, `llama-batched-bench`) llama.cpp runs
the same file in the same process tree, after the engine, with the same thread count and
repacking off (`--no-repack`; reported to crash on Q4_1 with AMX, which this machine lacks).

`--cases quant_moe`: a random Qwen3-MoE (the cluster bench's, about 75M parameters, 50M of them
in 8 experts of 8 layers, top 2) as float32 and quantized at load to int8 and int4, experts
included (kept quantized: one quantized GEMM pair per active expert): decode tok/s at batch 1, 8
and 32 and the weight bytes, side by side in one run."""

from __future__ import annotations

import gc
import json
import os
import subprocess

import torch

from engine.bench_common import decode_rates, line, llc_bytes, read_bandwidth
from engine.engine import Engine
from engine.gguf_model.smollm2 import smollm2_gguf_path

CONFIGS = {
    "F32": {"quantization": "none", "dtype": "float32"},
    "BF16": {"quantization": "none", "dtype": "bfloat16"},
    "Q4_1": {"quantization": "auto"},
    # the CPU decode graphs (off by default), a ladder up to 32 rows
    "Q4_1 graphs": {"quantization": "auto", "cpu_graph": "on", "cpu_graph_max_bs": 32},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
}


def llama_cpp_rates(bin_dir: str, path: str, threads: int, batches: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """llama.cpp on the same file: `llama-batched-bench` with `batches` parallel sequences of a
    128-token prompt and 128 new tokens each -> {batch: {"decode": S_TG, "prefill": S_PP}} (tok/s),
    plus llama-bench's tg128 at batch 1 as "decode_tg128"."""
    rates: dict[int, dict[str, float]] = {}
    cmd = [os.path.join(bin_dir, "llama-batched-bench"), "-m", path, "-t", str(threads), "-tb", str(threads),
           "-c", str(256 * max(batches)), "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "128",
           "-npl", ",".join(map(str, batches)), "--no-repack"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        print(f"quant      llama-batched-bench failed: {out.stderr.strip()[-300:]}", flush=True)
    for row in out.stdout.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == "128" and cells[2].isdigit():
            rates[int(cells[2])] = {"prefill": float(cells[5]), "decode": float(cells[7])}
    bench = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", path, "-t", str(threads), "-p", "0",
                            "-n", "128", "--repack", "0", "-r", "5", "-o", "json"],
                           capture_output=True, text=True, timeout=600)
    if bench.returncode == 0:
        row = next(r for r in json.loads(bench.stdout) if r.get("n_gen") == 128)
        rates.setdefault(1, {})["decode_tg128"] = float(row["avg_ts"])
    else:
        print(f"quant      llama-bench failed: {bench.stderr.strip()[-300:]}", flush=True)
    return rates


def case_quant(path: str, scale: float, llama_cpp: str | None = None) -> None:
    gguf = smollm2_gguf_path()
    nbytes = max(1 << 30, 4 * llc_bytes())
    bandwidth = max(read_bandwidth(nbytes).values())
    print(f"quant      SmolLM2-135M-Instruct ({os.path.basename(gguf)}); read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"{torch.get_num_threads()} threads", flush=True)
    weight_bytes = {}
    for name, kw in CONFIGS.items():
        eng = Engine(model_path=gguf, max_total_tokens=4096, **{**kw, "cpu_graph": "off"})
        weight_bytes[name] = eng.model_runner.model.weight_bytes()
        del eng
        gc.collect()
    out_len, rounds = (128, 2) if scale >= 1 else (16, 1)
    results: dict[int, dict[str, dict]] = {}
    for bs in (1, 8, 32):
        results[bs] = r = decode_rates(gguf, bs, out_len, rounds, CONFIGS)
        for name in CONFIGS:
            gbps = weight_bytes[name] / (r[name]["step_ms"] / 1e3) / 1e9
            print(f"quant      bs={bs:<2} {name:11}: decode {r[name]['decode']:8.1f} tok/s, {r[name]['step_ms']:7.2f} ms/step, "
                  f"prefill {r[name]['prefill']:8.0f} tok/s, weights {weight_bytes[name] / 1e6:6.1f} MB "
                  f"-> {gbps:5.1f} GB/s read ({gbps * 1e9 / bandwidth:.0%} of the measured bandwidth)", flush=True)
        line("quant", f"Q4_1 bs={bs}", r["Q4_1"]["decode"], "F32", r["F32"]["decode"], "decode tok/s",
             "(floor: 4x at batch 1; every format >= F32)")
        line("quant", f"Q4_1 prefill bs={bs}", r["Q4_1"]["prefill"], "F32", r["F32"]["prefill"], "prompt tok/s",
             "(floor 0.8x)")
    if llama_cpp:
        lc = llama_cpp_rates(llama_cpp, gguf, torch.get_num_threads(), (1, 8, 32))
        for bs, rate in sorted(lc.items()):
            if "decode" in rate:
                line("quant", f"Q4_1 bs={bs} radixray", results[bs]["Q4_1"]["decode"], "llama.cpp", rate["decode"],
                     "decode tok/s", f"(llama-batched-bench S_TG, --no-repack; floor 1.0x at batch 1 and 8, 1.2x "
                     f"at 32; prefill {results[bs]['Q4_1']['prefill']:,.0f} vs {rate['prefill']:,.0f} tok/s)")
            if "decode_tg128" in rate:
                line("quant", "Q4_1 bs=1 radixray", results[1]["Q4_1"]["decode"], "llama.cpp", rate["decode_tg128"],
                     "decode tok/s", "(llama-bench tg128, --repack 0, 5 repetitions)")


MOE_CONFIGS = {"F32": {"quantization": "none"}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}


def case_quant_moe(path: str, scale: float) -> None:
    """The MoE model at `path` as float32, int8 and int4 (module docstring)."""
    weight_bytes = {}
    for name, kw in MOE_CONFIGS.items():
        eng = Engine(model_path=path, max_total_tokens=4096, **kw)
        weight_bytes[name] = eng.model_runner.model.weight_bytes()
        del eng
        gc.collect()
    out_len, rounds = (128, 2) if scale >= 1 else (16, 1)
    for bs in (1, 8, 32):
        r = decode_rates(path, bs, out_len, rounds, MOE_CONFIGS)
        for name in MOE_CONFIGS:
            print(f"quant_moe  bs={bs:<2} {name:4}: decode {r[name]['decode']:8.1f} tok/s, {r[name]['step_ms']:7.2f} "
                  f"ms/step, prefill {r[name]['prefill']:8.0f} tok/s, weights {weight_bytes[name] / 1e6:6.1f} MB",
                  flush=True)
        for name in ("int8", "int4"):
            line("quant_moe", f"{name} bs={bs}", r[name]["decode"], "F32", r["F32"]["decode"], "decode tok/s")
