"""The Ray Data batch job (`cluster.batch`): folders of JSONL and Parquet files give what
`Cluster.generate` gives, bad rows become error rows, a duplicate id runs once, 10,000 rows pass
with a bounded driver, a job killed midway resumes without losing or repeating an id, and S3
(moto's server) serves as input and output as local paths do, resume included."""

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


def shard_rows(name: str, data: bytes) -> list[dict]:
    """A shard's rows as JSONL would give them (Parquet's nulls left out)."""
    if name.endswith(".parquet"):
        return [{k: v for k, v in r.items() if v is not None} for r in pq.read_table(pa.BufferReader(data)).to_pylist()]
    return [json.loads(line) for line in data.decode().splitlines()]


def by_id(rows: list[dict]) -> dict[str, dict]:
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r for r in rows}


def read_results(folder: Path) -> dict[str, dict]:
    """Every committed shard's rows by id (asserts no id appears twice)."""
    return by_id([r for shard in sorted(folder.glob("part-*")) for r in shard_rows(shard.name, shard.read_bytes())])


def engine_config(model: str, engines: int):
    from cluster.config import ClusterConfig

    return ClusterConfig(model_path=model, num_engines=engines, device="cpu")


@pytest.fixture(scope="module")
def reference(ray_local, model_dirs) -> dict[str, object]:
    """Each good row through Cluster.generate, with the job's own mapping of its fields."""
    from cluster import Cluster
    from cluster.batch import BatchLine
    from openai_api.params import DEFAULT_MAX_TOKENS
    from openai_api.served_model import served_model_name

    model = model_dirs["llama"]
    out = {}
    with Cluster(engine_config(model, 1)) as cl:
        for row in good_rows(served_model_name(model)):
            line = msgspec.convert(row, BatchLine)
            out[str(row["id"])] = cl.generate(prompt=line.prompt, messages=line.messages,
                                              sampling_params=line.sampling_params(DEFAULT_MAX_TOKENS))
    return out


def run_job(folder: Path | str, out: Path | str, model: str, output_format: str, engines: int = 2):
    from cluster.batch import BatchOptions, run

    # Small windows and shards: several of each, over every engine.
    opts = BatchOptions(input=str(folder), output=str(out), output_format=output_format, window=4, group_rows=8,
                        rows_per_shard=5, progress=False)
    return run(opts, engine_config(model, engines))


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
    from openai_api.served_model import served_model_name

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


def parquet_file(rows: list[dict]) -> bytes:
    """Rows as one Parquet file: a column per field, null where a row has none; ids as strings (one
    Parquet column, one type)."""
    rows = [r | {"id": str(r["id"])} for r in rows]
    keys = sorted({k for r in rows for k in r})
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), sink)
    return sink.getvalue().to_pybytes()


# A bad row in each input format (besides a line that is not JSON).
JSONL_BAD = {"id": "other-model", "prompt": "hi", "model": "gpt-4o"}
PARQUET_BAD = {"id": "too-long", "prompt": "y" * 1100}


@pytest.fixture(scope="module")
def mixed_files(model_dirs) -> dict[str, bytes]:
    """JSONL and Parquet files holding every good row, a bad row in each format and a line that is
    not JSON: read from a local folder (mixed_run) and from S3, they give the same rows."""
    from openai_api.served_model import served_model_name

    good = good_rows(served_model_name(model_dirs["llama"]))
    return {"a.jsonl": "\n".join([json.dumps(good[0]), "{not json"]  # no newline after the last line
                                 + [json.dumps(r) for r in good[2::3] + [JSONL_BAD]]).encode(),
            "sub/b.jsonl": ("\n".join(json.dumps(r) for r in good[3::3]) + "\n").encode(),
            "c.parquet": parquet_file(good[1::6]),
            "sub/d.parquet": parquet_file(good[4::6] + [PARQUET_BAD])}


@pytest.fixture(scope="module")
def mixed_run(ray_local, model_dirs, mixed_files, tmp_path_factory) -> tuple[Path, Path]:
    """The mixed files from a local folder to local Parquet shards: (input folder, output folder)."""
    root = tmp_path_factory.mktemp("mixed")
    for name, data in mixed_files.items():
        (root / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "in" / name).write_bytes(data)
    run_job(root / "in", root / "out", model_dirs["llama"], "parquet", engines=1)
    return root / "in", root / "out"


def test_parquet_and_jsonl_files_to_parquet_shards_match_cluster_generate(model_dirs, mixed_run, reference):
    """Parquet input (nulls where a row has no field) gives what JSONL gives; Parquet output."""
    from openai_api.served_model import served_model_name

    folder, out = mixed_run
    results = read_results(out)
    bad_json = f"{folder}/a.jsonl:2"
    good = good_rows(served_model_name(model_dirs["llama"]))
    assert set(results) == {str(r["id"]) for r in good} | {"other-model", "too-long", bad_json}
    assert_matches(results, reference)
    assert "context" in results["too-long"]["error"] and "does not exist" in results["other-model"]["error"]
    assert "invalid JSON" in results[bad_json]["error"]
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


def test_the_claim_table_and_the_writer_start_without_the_engine():
    """No Ray: the SeenIds actor's and the writer's processes import their own modules, not the
    engine and torch (seconds of CPU in every job's start-up); every public name still resolves."""
    import cluster.batch

    code = ("import sys, cluster.batch.ids, cluster.batch.shards; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'engine', 'openai_api', 'actors'}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]
    for name in cluster.batch.__all__:
        getattr(cluster.batch, name)


# ---- duplicate ids ----------------------------------------------------------------------------------
def test_seen_ids_first_claim_wins_and_a_retried_claim_holds():
    """No Ray: the claim table behind duplicate detection, against a dict, over many small claims
    (so its runs merge), with some claims repeated as a retried read task would repeat them."""
    import random

    from cluster.batch import SeenIds, id_digests, place_digests

    seen, owner, rng, line = SeenIds(), {}, random.Random(0), 0
    for k in range(400):
        ids = [f"id{rng.randrange(3000)}" for _ in range(rng.randrange(40))]
        places = [f"f:{line + i}" for i in range(len(ids))]
        line += len(ids)
        want = [owner.setdefault(rid, place) == place for rid, place in zip(ids, places)]
        assert seen.claim(id_digests(ids), place_digests(places)).tolist() == want
        if k % 5 == 0:  # the same rows again: each keeps what it had
            assert seen.claim(id_digests(ids), place_digests(places)).tolist() == want
    assert len(seen) == len(owner)
    sizes = [len(run) for run in seen._ids]
    assert all(a > 2 * b for a, b in zip(sizes, sizes[1:])), sizes  # few runs to search


def test_duplicate_ids_run_once_and_later_rows_become_errors(ray_local, model_dirs, tmp_path):
    """The first row read with an id runs; each later one is an error row named by its place,
    within a file and across files read by different tasks; a re-run adds nothing."""
    def row(rid: object, prompt: str, n: int, **extra: object) -> dict:
        return {"id": rid, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True} | extra

    folder, out = tmp_path / "in", tmp_path / "out"
    folder.mkdir()
    a, b = folder / "a.jsonl", folder / "b.jsonl"
    a.write_text("\n".join(json.dumps(r) for r in [
        row("dup", "Lily", 3), row("solo", "Tom", 2), row("dup", "Lily", 5),  # lines 1-3
        row("dup", "x", 2, best_of=2),  # 4: a duplicate and invalid: the duplicate is what counts
        row("cross", "Ann", 4),  # 5: also in b.jsonl, which the other read task reads
        row("bad-first", "hi", 2, temperature="hot"), row("bad-first", "hi", 2),  # 6, 7
        row(7, "Sam", 2), row("7", "Sam", 2)]) + "\n")  # 8, 9: the same id in the output
    b.write_text("\n".join(json.dumps(r) for r in [row("cross", "Ann", 4), row("only-b", "Bo", 2)]) + "\n")
    summary = run_job(folder, out, model_dirs["llama"], "jsonl", engines=1)  # two read tasks whatever the engines

    results = read_results(out)  # asserts that no id is written twice
    dups = {f"{a}:3": "dup", f"{a}:4": "dup", f"{a}:7": "bad-first", f"{a}:9": "7"}
    cross = {f"{a}:5", f"{b}:1"} & set(results)
    assert len(cross) == 1, cross  # whichever task read "cross" first ran it
    dups[cross.pop()] = "cross"
    assert set(results) == {"dup", "solo", "cross", "bad-first", "7", "only-b"} | set(dups)
    for place, rid in dups.items():
        assert results[place] == {"id": place, "error": f"duplicate id {rid!r}: ids must be unique; only the "
                                                        "first row read with it is run"}
    assert results["dup"]["completion_tokens"] == 3  # line 1's, not line 3's
    assert results["cross"]["completion_tokens"] == 4 and results["7"]["completion_tokens"] == 2
    assert "invalid fields" in results["bad-first"]["error"]
    assert (summary.rows, summary.errors) == (len(results), len(dups) + 1)

    again = run_job(folder, out, model_dirs["llama"], "jsonl", engines=1)  # nothing to generate
    assert (again.rows, again.skipped) == (0, len(results))
    assert read_results(out) == results


# ---- the job as a process: memory, kill and resume ------------------------------------------------
# A driver process of its own that runs jobs (JSON lists of `python -m cluster batch` arguments)
# one after another: after each, its summary line and the process's peak RSS so far, in KiB.
# VmHWM, not ru_maxrss: Linux carries the parent's high-water mark into ru_maxrss across the
# (v)fork and exec that start the driver, so ru_maxrss would report the pytest process's peak.
DRIVER = ("import json, re, sys\n"
          "from cluster.batch import main\n"
          "for args in json.loads(sys.argv[1]):\n"
          "    assert main(args) == 0\n"
          "    hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
          "    print('peak_rss_kb', hwm, flush=True)\n")


def write_short_rows(folder: Path, n: int, files: int = 4) -> None:
    """n rows over `files` files; one token each (its window's prefill makes it)."""
    folder.mkdir(parents=True)
    for f in range(files):
        with open(folder / f"p{f}.jsonl", "w") as fh:
            for i in range(f, n, files):
                fh.write(json.dumps({"id": f"r{i}", "prompt": f"tenant {i % 10} asks question {i}",
                                     "max_tokens": 1, "temperature": 0, "ignore_eos": True}) + "\n")


def job_args(folder: Path, out: Path, model: str, *extra: str) -> list[str]:
    """`python -m cluster batch` arguments for a job on this session's Ray."""
    import ray

    return ["--input", str(folder), "--output", str(out), "--model", model, "--engines", "2",
            "--address", ray.get_runtime_context().gcs_address, "--no-progress", *extra]


def job_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def run_driver(*jobs: list[str]) -> list[tuple[tuple[int, int, int], int]]:
    """Jobs one after another in a driver process of its own: for each, (rows, errors,
    already_done) from its summary line, and the driver's peak RSS in KiB once it is done."""
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(jobs)], cwd=ROOT, env=job_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    counts = re.findall(r"^batch: rows=(\d+) errors=(\d+) .* already_done=(\d+)$", r.stdout, re.M)
    peaks = re.findall(r"^peak_rss_kb (\d+)$", r.stdout, re.M)
    assert len(counts) == len(peaks) == len(jobs), r.stdout[-3000:]
    return [(tuple(map(int, c)), int(kb)) for c, kb in zip(counts, peaks)]


def test_ten_thousand_rows_once_each_with_a_bounded_driver(ray_local, model_dirs, tmp_path):
    model = model_dirs["llama"]
    write_short_rows(tmp_path / "small", 200)
    write_short_rows(tmp_path / "big", 10_000)
    (_, small_kb), (counts, big_kb) = run_driver(job_args(tmp_path / "small", tmp_path / "small_out", model),
                                                 job_args(tmp_path / "big", tmp_path / "big_out", model))

    results = read_results(tmp_path / "big_out")
    assert set(results) == {f"r{i}" for i in range(10_000)}
    assert all(r["completion_tokens"] == 1 for r in results.values())
    assert counts == (10_000, 0, 0)
    # The driver holds per-shard reports, never the rows: 50x the rows cost it next to nothing
    # over the peak a 200-row job left (the driver-loop job it replaced, which held every row,
    # grew by ~55 MB on this input).
    assert big_kb - small_kb < 32 * 1024, (small_kb, big_kb)
    assert big_kb < 1024 * 1024, big_kb


def running(pid: int) -> bool:
    """Whether a process with this id is alive (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def writer_processes(skip: set[str]) -> list[int]:
    """The processes of the batch jobs' shard writers (actors not in skip) that may still run."""
    import ray._private.state  # the GCS's actor table (the state API needs a dashboard this Ray has not)

    return [a["Pid"] for aid, a in ray._private.state.actors().items()
            if aid not in skip and "WriteShards" in a["ActorClassName"]
            and (a["State"] != "DEAD" or (a["Pid"] > 0 and running(a["Pid"])))]


def test_killed_midway_resumes_with_every_id_once(ray_local, model_dirs, tmp_path):
    """The job killed as soon as it has committed a shard; a new run writes every other id."""
    import ray._private.state

    from cluster.batch import BatchOptions, run

    model = model_dirs["llama"]
    rows = 1_000  # twenty shards: the kill lands with most of them still to come
    folder, out = tmp_path / "in", tmp_path / "out"
    write_short_rows(folder, rows)
    earlier = set(ray._private.state.actors())
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "batch", *job_args(folder, out, model,
                                                                               "--rows-per-shard", "50")],
                            cwd=ROOT, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob("part-*")) and proc.poll() is None:
            assert time.monotonic() < deadline, "no shard committed in 300 s"
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    # The dead driver's actors go down shortly after it, and until its writer's process is gone a
    # shard already being written may still land.
    deadline = time.monotonic() + 120
    while writer_processes(earlier):
        assert time.monotonic() < deadline, writer_processes(earlier)
        time.sleep(0.1)
    before = read_results(out)  # every committed shard is whole: each line parses
    assert 0 < len(before) < rows
    # A shard a kill interrupted mid-write: under its temporary name it never counts.
    torn = out / ".part-0123456789abcdef0123.jsonl.tmp"
    torn.write_text(json.dumps({"id": "r1", "text": "x"}) + '\n{"id": "r2", "te')

    summary = run(BatchOptions(input=str(folder), output=str(out), rows_per_shard=50, progress=False),
                  engine_config(model, 2))
    assert (summary.rows, summary.errors, summary.skipped) == (rows - len(before), 0, len(before))
    after = read_results(out)
    assert set(after) == {f"r{i}" for i in range(rows)}
    assert all(after[rid] == row for rid, row in before.items())
    assert not torn.exists()


# ---- object storage: S3, through moto's server ---------------------------------------------------
# 5.2.1 answers CompleteMultipartUpload under the wrong root element, which pyarrow takes for an
# error (getmoto/moto#10055); pyproject's test extras ask for this or later.
MOTO_MIN_VERSION = "5.2.5"


class S3:
    """A local S3 (moto's server, on a thread of this process) and a boto3 client for it."""

    def __init__(self, host: str, port: int) -> None:
        import boto3

        endpoint = f"http://{host}:{port}"
        self.host_port = f"{host}:{port}"
        # What pyarrow (the job's filesystems) reads: credentials, region, where S3 is; and no
        # EC2 instance-metadata lookups for credentials.
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}
        self.client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                                   aws_secret_access_key="testing", region_name="us-east-1")

    def uri(self, bucket: str, path: str) -> str:
        """A URI that carries where S3 is and its credentials (pyarrow's URI options): a job's Ray
        workers then need nothing from their environment."""
        return (f"s3://testing:testing@{bucket}/{path}?endpoint_override={self.host_port}&scheme=http"
                "&region=us-east-1")

    def bucket(self) -> str:
        """A new bucket, versioned: every object ever written under a key stays listed."""
        import uuid

        name = f"rr-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        self.client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
        return name

    def keys(self, bucket: str, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def written(self, bucket: str, prefix: str) -> list[str]:
        """Every object version ever written under prefix (deleted ones too), by key."""
        pages = self.client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(v["Key"] for page in pages for v in page.get("Versions", []))

    def read(self, bucket: str, key: str) -> bytes:
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def results(self, bucket: str, prefix: str) -> dict[str, dict]:
        """Every committed shard's rows under prefix, by id (asserts no id appears twice)."""
        return by_id([r for key in self.keys(bucket, prefix) if key.rsplit("/", 1)[1].startswith("part-")
                      for r in shard_rows(key, self.read(bucket, key))])


@pytest.fixture(scope="module")
def s3():
    from packaging.version import Version

    moto = pytest.importorskip("moto", reason="the S3 tests need moto[server] (in the test extras)")
    if Version(moto.__version__) < Version(MOTO_MIN_VERSION):
        pytest.skip(f"moto {moto.__version__} breaks pyarrow's multipart uploads (getmoto/moto#10055): "
                    f"pip install 'moto[server]>={MOTO_MIN_VERSION}'")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # port 0: a free one
    server.start()
    host, port = server.get_host_and_port()
    yield S3(host, port)
    server.stop()


def test_shards_on_s3_are_uploaded_under_their_final_names(s3, monkeypatch):
    """No Ray: on S3 a shard is one upload under its final name (no temporary, no copy: the bucket's
    versions list every object ever written); resume reads it back; a stale temporary is removed;
    inputs resolve as on a local disk; and a writer killed mid-upload leaves no object."""
    from cluster.batch import WriteShards, committed_shards, load_done_ids, resolve_input
    from cluster.batch.shards import _remove_stale_temporaries

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    bucket = s3.bucket()
    rows = pa.Table.from_pylist([{"id": "a", "text": "hi", "prompt_tokens": 3, "completion_tokens": 1,
                                  "cached_tokens": 0, "finish_reason": "length", "error": None},
                                 {"id": "b", "text": None, "prompt_tokens": None, "completion_tokens": None,
                                  "cached_tokens": None, "finish_reason": None, "error": "invalid JSON"}])
    out, names = f"s3://{bucket}/out", set()
    for fmt in ("jsonl", "parquet"):
        report = WriteShards(out, fmt)(rows).to_pylist()[0]
        assert report["path"].startswith(f"{bucket}/out/part-") and report["path"].endswith(fmt)
        names.add(os.path.basename(report["path"]))
        assert s3.results(bucket, "out/") == {"a": {"id": "a", "text": "hi", "prompt_tokens": 3, "completion_tokens": 1,
                                                    "cached_tokens": 0, "finish_reason": "length"},
                                              "b": {"id": "b", "error": "invalid JSON"}}
        if fmt == "jsonl":
            s3.client.delete_object(Bucket=bucket, Key=report["path"].split("/", 1)[1])
    WriteShards(out, "parquet")(rows)  # a retried write: the same shard again
    shards = committed_shards(out)
    assert [os.path.basename(p) for p in shards] == [n for n in names if n.endswith(".parquet")]
    assert len(load_done_ids(out)) == 2
    # Every object ever written under out/ is a shard under its final name (or the folder's marker).
    assert set(s3.written(bucket, "out/")) - {"out/"} == {f"out/{n}" for n in names}

    torn = "out/.part-0123456789abcdef0123.jsonl.tmp"  # left by an older job or another filesystem
    s3.put(bucket, torn, b'{"id": "c"}\n{"id": "d", "te')
    assert committed_shards(out) == shards
    _remove_stale_temporaries(out)
    assert s3.keys(bucket, "out/.") == []

    for key in ("in/a.jsonl", "in/sub/b.jsonl", "in/c.parquet", "in/_skip.jsonl", "in/x.txt"):
        s3.put(bucket, key, b"")
    assert resolve_input(f"s3://{bucket}/in")[0] == [f"{bucket}/in/a.jsonl", f"{bucket}/in/c.parquet",
                                                     f"{bucket}/in/sub/b.jsonl"]
    assert resolve_input(f"s3://{bucket}/in/*/*.jsonl")[0] == [f"{bucket}/in/sub/b.jsonl"]

    # What writing under the final name rests on: an upload cut off (here after a 10 MiB part went
    # up) leaves no object, only an unfinished multipart upload that no listing shows.
    # (filesystem_for's filesystem: pyarrow's for the URI.)
    cut = ("import os, sys; from pyarrow import fs; s3, path = fs.FileSystem.from_uri(sys.argv[1]); "
           "f = s3.open_output_stream(path); f.write(b'x' * (12 << 20)); f.flush(); os._exit(0)")
    subprocess.run([sys.executable, "-c", cut, f"s3://{bucket}/out/part-cut.jsonl"], cwd=ROOT, check=True,
                   timeout=120)
    assert [u["Key"] for u in s3.client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == [
        "out/part-cut.jsonl"]
    assert committed_shards(out) == shards


def test_s3_input_and_output_match_local_paths_and_resume(model_dirs, s3, mixed_files, mixed_run):
    """The same JSONL and Parquet files, from a local folder to local Parquet shards (mixed_run)
    and from S3 to JSONL shards on S3: the same rows. Then shards deleted from S3 (as if the job
    had been killed before writing them) and a torn temporary added: a re-run writes exactly the
    missing rows."""
    model = model_dirs["llama"]
    bucket = s3.bucket()
    for name, data in mixed_files.items():
        s3.put(bucket, f"in/{name}", data)
    folder, out = mixed_run
    local = read_results(out)
    summary = run_job(s3.uri(bucket, "in"), s3.uri(bucket, "out"), model, "jsonl", engines=1)
    remote = s3.results(bucket, "out/")

    def same(rows: dict[str, dict], folder: str) -> dict[str, dict]:
        # A place names the file as its filesystem does; cached tokens depend on the engines' count.
        return {rid.removeprefix(folder): {k: v for k, v in r.items() if k not in ("id", "cached_tokens")}
                for rid, r in rows.items()}

    errors = 3  # a line that is not JSON, a bad row in each format
    assert len(local) == len(good_rows("")) + errors
    assert same(remote, f"{bucket}/in/") == same(local, f"{folder}/")
    assert (summary.rows, summary.errors, summary.skipped) == (len(remote), errors, 0)

    shards = [k for k in s3.keys(bucket, "out/") if k.startswith("out/part-")]
    gone, kept = shards[::2], shards[1::2]
    lost = [r for key in gone for r in shard_rows(key, s3.read(bucket, key))]
    for key in gone:
        s3.client.delete_object(Bucket=bucket, Key=key)
    torn = "out/.part-0123456789abcdef0123.jsonl.tmp"
    s3.put(bucket, torn, b'{"id": "g1", "text": "x"}\n{"id": "g2", "te')
    summary = run_job(s3.uri(bucket, "in/"), s3.uri(bucket, "out/"), model, "jsonl", engines=1)
    assert (summary.rows, summary.errors, summary.skipped) == (len(lost), sum("error" in r for r in lost),
                                                               len(remote) - len(lost))
    assert same(s3.results(bucket, "out/"), "") == same(remote, "")
    assert s3.keys(bucket, "out/.") == []  # the torn temporary is gone
    written = s3.written(bucket, "out/")
    assert all(written.count(key) == 1 for key in kept)  # kept shards were not written again
    assert [k for k in written if ".tmp" in k] == [torn]  # the job itself wrote no temporary
