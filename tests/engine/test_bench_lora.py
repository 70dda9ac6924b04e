"""`python -m engine.bench --cases lora` at its smallest scale on the tiny random Llama: every
adapter count gets its numbers, the base-model rows' output equals a plain engine's, the adapter
loads are timed, the plot is written."""

from __future__ import annotations

import importlib.util
import math

from engine.bench import CASES
from engine.bench_lora import COUNTS, OFF, case_lora


def test_lora_case_smoke(model_dirs, tmp_path, capsys):
    assert CASES["lora"] is case_lora
    plot = tmp_path / "lora.png" if importlib.util.find_spec("matplotlib") else None
    r = case_lora(model_dirs["llama"], 0.01, plot_path=str(plot) if plot else None)
    for key in (OFF, *COUNTS):
        assert math.isfinite(r[key]["tok_s"]) and r[key]["tok_s"] > 0, key
        assert math.isfinite(r[key]["step_ms"]) and r[key]["step_ms"] > 0, key
    # The base model's rows on the LoRA engine: the plain engine's tokens, every round.
    assert r["base_tokens"] and r["base_tokens"] == r["off_tokens"]
    assert all(len(t) == 32 for t in r["base_tokens"])
    load = r["load"]
    assert load["adapters"] == max(COUNTS) and load["mb"] > 0 and load["ms_per_mb"] > 0
    out = capsys.readouterr().out
    for n in COUNTS[1:]:
        assert f"lora       {n}_adapters=" in out
    assert "floor >= 0.75x" in out and "floor >= 0.6x" in out
    assert "max_loras_per_batch=32: all 32 adapters in one batch" in out
    assert "load_lora_adapter: 32 adapters" in out
    if plot:
        assert plot.stat().st_size > 0
