"""The Ray Data batch job (`cluster.batch`): folders of JSONL and Parquet files give what
`Cluster.generate` gives, bad rows become error rows, 10,000 rows pass with a bounded driver, and
a job killed midway resumes without losing or repeating an id."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PREFIXES = ["Once upon a time, in a small village by the sea, ", "The robot opened the door and said: "]


def good_rows(model_name: str) -> list[dict]:
    """Rows sharing two prefixes, some chat messages, a few sampling fields (greedy throughout)."""
    rows = []
    for i in range(14):
        row = {"id": f"g{i}", "prompt": PREFIXES[i % 2] + f"question {i}?", "max_tokens": 6 + i % 3,
               "temperature": 0}
        if i % 5 == 1:
            row |= {"stop": ["e"], "ignore_eos": True}
        rows.append(row)
    rows.append({"id": 7001, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 5,
                 "temperature": 0})
    rows.append({"id": "chat", "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
    rows.append({"id": "named", "model": model_name, "prompt": "Lily", "max_tokens": 3, "temperature": 0})
    return rows


def bad_rows() -> list[dict]:
    """id -> what its error must mention (the invalid JSON line is added per file)."""
    return [{"id": "unknown-field", "prompt": "hi", "best_of": 2},
            {"id": "other-model", "prompt": "hi", "model": "gpt-4o"},
            {"id": "too-long", "prompt": "x" * 1100, "max_tokens": 4},
            {"id": "hot", "prompt": "hi", "temperature": "hot"}]


BAD_MESSAGES = {"unknown-field": "best_of", "other-model": "does not exist", "too-long": "context",
                "hot": "invalid fields"}


def read_results(folder: Path) -> dict[str, dict]:
    """Every committed shard's rows by id (asserts no id appears twice)."""
    rows: list[dict] = []
    for shard in sorted(folder.glob("part-*")):
        if shard.suffix == ".parquet":
            rows += [{k: v for k, v in r.items() if v is not None} for r in pq.read_table(shard).to_pylist()]
        else:
            rows += [json.loads(line) for line in shard.read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r for r in rows}


def engine_config(model: str, engines: int):
    from cluster.config import ClusterConfig

    return ClusterConfig(model_path=model, num_engines=engines, device="cpu")


@pytest.fixture(scope="module")
def reference(ray_local, model_dirs) -> dict[str, object]:
    """Each good row through Cluster.generate, with the job's own mapping of its fields."""
    from cluster import Cluster
    from cluster.batch import DEFAULT_MAX_TOKENS, BatchLine, served_model_name

    model = model_dirs["llama"]
    out = {}
    with Cluster(engine_config(model, 1)) as cl:
        for row in good_rows(served_model_name(model)):
            line = msgspec.convert(row, BatchLine)
            out[str(row["id"])] = cl.generate(prompt=line.prompt, messages=line.messages,
                                              sampling_params=line.sampling_params(DEFAULT_MAX_TOKENS))
    return out


def run_job(folder: Path, out: Path, model: str, output_format: str):
    from cluster.batch import BatchOptions, run

    # Small windows and shards: several of each, over both engines.
    opts = BatchOptions(input=str(folder), output=str(out), output_format=output_format, window=4, group_rows=8,
                        rows_per_shard=5, progress=False)
    return run(opts, engine_config(model, 2))


def assert_matches(results: dict[str, dict], reference: dict[str, object]) -> None:
    for rid, ref in reference.items():
        got = results[rid]
        assert "error" not in got, got
        assert got["text"] == ref.text, rid
        assert got["completion_tokens"] == len(ref.token_ids) and got["prompt_tokens"] == ref.prompt_tokens, rid
        assert got["finish_reason"] == ref.finish_reason, rid
        assert 0 <= got["cached_tokens"] < got["prompt_tokens"]


def test_jsonl_folder_matches_cluster_generate_and_bad_rows_become_errors(ray_local, model_dirs, reference,
                                                                          tmp_path):
    from cluster.batch import served_model_name

    model = model_dirs["llama"]
    rows = good_rows(served_model_name(model)) + bad_rows()
    folder = tmp_path / "in"
    (folder / "more").mkdir(parents=True)
    paths = [folder / "a.jsonl", folder / "b.jsonl", folder / "more" / "c.jsonl"]
    for k, path in enumerate(paths):
        lines = [json.dumps(r) for r in rows[k::3]]
        lines.insert(1, "{not json")  # line 2 of every file
        path.write_text("\n".join(lines) + "\n\n")  # a blank line is skipped, not an error
    (folder / "notes.txt").write_text("not an input file")
    out = tmp_path / "out"
    summary = run_job(folder, out, model, "jsonl")

    results = read_results(out)
    bad_json = {f"{p}:2" for p in paths}
    assert set(results) == {str(r["id"]) for r in rows} | bad_json
    assert_matches(results, reference)
    for rid in bad_json:
        assert set(results[rid]) == {"id", "error"} and "invalid JSON" in results[rid]["error"]
    for rid, needle in BAD_MESSAGES.items():
        assert set(results[rid]) == {"id", "error"} and needle in results[rid]["error"], results[rid]
    assert summary.rows == len(results) and summary.errors == len(BAD_MESSAGES) + len(bad_json)
    assert summary.completion_tokens == sum(r.get("completion_tokens", 0) for r in results.values())
    assert summary.cached_tokens > 0 and summary.shards == len(list(out.glob("part-*.jsonl"))) > 1


def test_parquet_folder_matches_cluster_generate(ray_local, model_dirs, reference, tmp_path):
    from cluster.batch import served_model_name

    model = model_dirs["llama"]
    rows = good_rows(served_model_name(model)) + [{"id": "too-long", "prompt": "y" * 1100}]
    for r in rows:
        r["id"] = str(r["id"])  # one Parquet column, one type
    folder = tmp_path / "in"
    folder.mkdir()
    keys = sorted({k for r in rows for k in r})  # a column per field; null where a row has none
    for k in range(3):
        pq.write_table(pa.Table.from_pylist([{key: r.get(key) for key in keys} for r in rows[k::3]]),
                       folder / f"part{k}.parquet")
    out = tmp_path / "out"
    run_job(folder, out, model, "parquet")

    results = read_results(out)
    assert set(results) == {r["id"] for r in rows}
    assert_matches(results, reference)
    assert "context" in results["too-long"]["error"]
    assert pq.read_schema(next(out.glob("part-*.parquet"))).names == [
        "id", "text", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "error", "tool_calls",
        "prompt_logprobs"]


def test_tools_echo_and_prompt_logprobs_rows(ray_local, model_dirs, tmp_path):
    """The chat-completions fields in input lines, through the job's stages (without Ray Data):
    tools rendered and a required call constrained, echo, prompt_logprobs; in both output formats."""
    import asyncio

    import jsonschema
    import ray

    from cluster.batch import Generate, Preprocess, WriteShards

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": schema}}]
    chat = [{"role": "user", "content": "Pick a number"}]
    rows = [{"id": "call", "messages": chat, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
             "max_tokens": 200, "temperature": 0},
            {"id": "auto", "messages": chat, "tools": tools, "max_tokens": 4, "temperature": 0},
            {"id": "echo", "prompt": "Lily", "echo": True, "prompt_logprobs": 2, "max_tokens": 3, "temperature": 0},
            {"id": "bad-tool", "messages": chat, "tools": tools, "tool_choice": {"type": "function",
                                                                                  "function": {"name": "nope"}}}]
    config = msgspec.structs.asdict(engine_config(model_dirs["llama"], 1).engine_config("cpu"))
    raw = pa.table([[f"in:{i}" for i in range(len(rows))], [json.dumps(r) for r in rows]],
                   names=["src", "row"])
    work = pa.concat_tables(Preprocess(config, [ray.put(np.zeros(0, dtype="S16"))], 8, 8, "hermes")(raw))
    results = asyncio.run(Generate(config)(work))
    for fmt in ("jsonl", "parquet"):
        WriteShards(str(tmp_path / fmt), fmt)(results)
        got = read_results(tmp_path / fmt)
        assert "nope" in got["bad-tool"]["error"]
        call = got["call"]
        assert call["finish_reason"] == "tool_calls" and call["text"] == "" and len(call["tool_calls"]) == 1
        fn = call["tool_calls"][0]["function"]
        assert fn["name"] == "pick" and call["tool_calls"][0]["id"].startswith("call_")
        jsonschema.validate(json.loads(fn["arguments"]), schema)
        assert "tool_calls" not in got["auto"] and got["auto"]["completion_tokens"] == 4  # parsed: no call
        echo = got["echo"]
        assert echo["text"].startswith("Lily") and len(echo["text"]) > 4
        plp = echo["prompt_logprobs"]
        assert plp[0] is None and len(plp) == echo["prompt_tokens"]
        assert all(e["logprob"] <= 0 and e["rank"] >= 1 and len(e["top_logprobs"]) == 2 for e in plp[1:])


def test_inputs_globs_and_the_shard_commit(tmp_path):
    """No Ray: which files an --input names, and what a committed shard looks like."""
    from cluster.batch import WriteShards, committed_shards, load_done_ids, resolve_input
    from engine.errors import ConfigError

    for name in ("a.jsonl", "b.parquet", "sub/c.jsonl", "sub/d.jsonl.gz", "_skip.jsonl", ".hidden.jsonl", "x.txt"):
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text("")

    def names(spec: str) -> list[str]:
        return [os.path.relpath(p, tmp_path / "in") for p in resolve_input(spec)[0]]

    assert names(str(tmp_path / "in")) == ["a.jsonl", "b.parquet", "sub/c.jsonl", "sub/d.jsonl.gz"]
    assert names(str(tmp_path / "in" / "sub" / "*.jsonl")) == ["sub/c.jsonl"]
    assert names(str(tmp_path / "in" / "*" / "*.jsonl*")) == ["sub/c.jsonl", "sub/d.jsonl.gz"]
    assert names(str(tmp_path / "in" / "x.txt")) == ["x.txt"]  # a file named outright is read as JSONL
    for missing in ("nope", "in/*.csv"):
        with pytest.raises(ConfigError):
            resolve_input(str(tmp_path / missing))

    out = tmp_path / "out"
    rows = pa.Table.from_pylist([{"id": "a", "text": "hi", "prompt_tokens": 3, "completion_tokens": 1,
                                  "cached_tokens": 0, "finish_reason": "length", "error": None},
                                 {"id": "b", "text": None, "prompt_tokens": None, "completion_tokens": None,
                                  "cached_tokens": None, "finish_reason": None, "error": "invalid JSON"}])
    report = WriteShards(str(out), "jsonl")(rows).to_pylist()[0]
    (out / ".part-0000.jsonl.tmp").write_text('{"id": "c"}\n')  # being written: not committed
    assert [Path(p).name for p in committed_shards(str(out))] == [Path(report["path"]).name]
    assert [json.loads(line) for line in Path(report["path"]).read_text().splitlines()] == [
        {"id": "a", "text": "hi", "prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0,
         "finish_reason": "length"}, {"id": "b", "error": "invalid JSON"}]
    assert (report["rows"], report["errors"], report["prompt_tokens"]) == (2, 1, 3)
    assert len(load_done_ids(str(out))) == 2
    # The same rows again (a retried write) land in the same shard, not in a second one.
    WriteShards(str(out), "jsonl")(rows)
    assert len(committed_shards(str(out))) == 1


# ---- the job as a process: memory, kill and resume ------------------------------------------------
PEAK_RSS = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print('peak_rss_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def write_short_rows(folder: Path, n: int, files: int = 4) -> None:
    folder.mkdir(parents=True)
    for f in range(files):
        with open(folder / f"p{f}.jsonl", "w") as fh:
            for i in range(f, n, files):
                fh.write(json.dumps({"id": f"r{i}", "prompt": f"tenant {i % 10} asks question {i}",
                                     "max_tokens": 2, "temperature": 0, "ignore_eos": True}) + "\n")


def job_argv(folder: Path, out: Path, model: str, *extra: str) -> list[str]:
    import ray

    return [sys.executable, "-m", "cluster", "batch", "--input", str(folder), "--output", str(out), "--model", model,
            "--engines", "2", "--address", ray.get_runtime_context().gcs_address, "--no-progress", *extra]


def job_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def summary_counts(stdout: str) -> tuple[int, int, int]:
    """(rows, errors, already_done) from the job's summary line."""
    m = re.search(r"^batch: rows=(\d+) errors=(\d+) .* already_done=(\d+)$", stdout, re.M)
    assert m, stdout[-2000:]
    return int(m[1]), int(m[2]), int(m[3])


def run_measured(argv: list[str]) -> tuple[str, int]:
    """Run the job in a process of its own; its output and its peak RSS in KiB."""
    r = subprocess.run([sys.executable, "-c", PEAK_RSS, *argv], cwd=ROOT, env=job_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout, int(r.stdout.rsplit("peak_rss_kb", 1)[1].split()[0])


def test_ten_thousand_rows_once_each_with_a_bounded_driver(ray_local, model_dirs, tmp_path):
    model = model_dirs["llama"]
    write_short_rows(tmp_path / "small", 200)
    write_short_rows(tmp_path / "big", 10_000)
    _, small_kb = run_measured(job_argv(tmp_path / "small", tmp_path / "small_out", model))
    stdout, big_kb = run_measured(job_argv(tmp_path / "big", tmp_path / "big_out", model))

    results = read_results(tmp_path / "big_out")
    assert set(results) == {f"r{i}" for i in range(10_000)}
    assert all(r["completion_tokens"] == 2 for r in results.values())
    assert summary_counts(stdout) == (10_000, 0, 0)
    # The driver holds per-shard reports, never the rows: 50x the rows cost it next to nothing
    # (the driver-loop job it replaced, which held every row, grew by ~55 MB on this input).
    assert big_kb - small_kb < 32 * 1024, (small_kb, big_kb)
    assert big_kb < 1024 * 1024, big_kb


def test_killed_midway_resumes_with_every_id_once(ray_local, model_dirs, tmp_path):
    model = model_dirs["llama"]
    folder, out = tmp_path / "in", tmp_path / "out"
    write_short_rows(folder, 10_000)
    argv = job_argv(folder, out, model, "--rows-per-shard", "200")
    proc = subprocess.Popen(argv, cwd=ROOT, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob("part-*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    # The dead driver's actors go down shortly after it: a shard already being written may still
    # land. Wait until nothing lands any more.
    shards: set[Path] = set()
    while set(out.glob("part-*")) != shards:
        shards = set(out.glob("part-*"))
        time.sleep(3)
    before = read_results(out)  # every committed shard is whole: each line parses
    assert 0 < len(before) < 10_000
    # A shard a kill interrupted mid-write: under its temporary name it never counts.
    torn = out / ".part-0123456789abcdef0123.jsonl.tmp"
    torn.write_text(json.dumps({"id": "r1", "text": "x"}) + '\n{"id": "r2", "te')

    stdout, _ = run_measured(argv)
    assert summary_counts(stdout) == (10_000 - len(before), 0, len(before))
    after = read_results(out)
    assert set(after) == {f"r{i}" for i in range(10_000)}
    assert all(after[rid] == row for rid, row in before.items())
    assert not torn.exists()
