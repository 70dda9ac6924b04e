"""The batch job through a real `ray job submit` on a local `ray start --head` cluster."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, data_path

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    port, dash = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray's token auth: one random token shared by the head and the job CLI.
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # No node drain on SIGTERM: the actors a Ray Data job leaves (its stats actor) would hold the
    # head's teardown for the whole 30 s drain timeout.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    ray_bin = str(Path(sys.executable).parent / "ray")
    log = open(tmp_path_factory.mktemp("ray-head") / "head.log", "w")
    # --block: the head lives exactly as long as this process; SIGTERM stops all of it.
    # A private temp dir: the head's address file must not outlive it in /tmp/ray, where a
    # later ray.init() without an address would find the dead cluster.
    temp_dir = tempfile.mkdtemp(prefix="rr", dir="/tmp")
    proc = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             f"--temp-dir={temp_dir}",
                             "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                             # Its own agent ports: another Ray on this machine (the test session's
                             # own) holds the defaults, and a job agent that cannot bind never comes up.
                             f"--dashboard-agent-listen-port={free_port()}",
                             f"--dashboard-agent-grpc-port={free_port()}",
                             f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
                             "--disable-usage-stats"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # up once a trivial job runs: `job list` answers before the job agent is up
        r = subprocess.run([ray_bin, "job", "submit", "--address", url, "--", "python", "-c", "pass"], env=env,
                           capture_output=True)
        if r.returncode == 0:
            break
        time.sleep(2)
    else:
        proc.terminate()
        pytest.fail("ray head did not come up")
    yield url, env, ray_bin
    proc.terminate()
    proc.wait(timeout=60)


def submit(ray_head, *args: str) -> subprocess.CompletedProcess:
    url, env, ray_bin = ray_head
    cmd = [ray_bin, "job", "submit", "--address", url, "--working-dir", str(ROOT), "--",
           "python", "-m", "cluster", "batch", *args]
    deadline = time.monotonic() + 120
    while True:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        # The head answers `job list` before its job agent is up: Ray says to try again later.
        if "No available agent" not in r.stdout + r.stderr or time.monotonic() > deadline:
            return r
        time.sleep(2)


def read_shards(folder: Path) -> list[dict]:
    return [json.loads(line) for shard in sorted(folder.glob("part-*.jsonl")) for line in shard.read_text().splitlines()]


def test_batch_job_via_ray_job_submit(ray_head, tmp_path):
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results"
    lines = [
        json.dumps({"id": "a", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}),
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8,
                    "temperature": 0.7, "seed": 3}),
        "{not json",
        json.dumps({"id": "c", "prompt": "The cat", "temperature": "hot"}),
        json.dumps({"id": "d", "prompt": "Lily", "max_tokens": 12, "stop": ["."], "temperature": 0}),
        json.dumps({"id": "e", "prompt": "Tom", "max_tokens": 10, "top_p": 0.9, "top_k": 20, "ignore_eos": True}),
    ]
    inp.write_text("\n".join(lines) + "\n")
    args = ["--input", str(inp), "--output", str(out), "--model", str(data_path("models/stories260K")), "--no-progress"]
    r = submit(ray_head, *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = {rec["id"]: rec for rec in read_shards(out)}
    bad_line = f"{inp}:3"  # no usable id: named by its place
    assert set(recs) == {"a", "b", bad_line, "c", "d", "e"}
    assert recs["a"]["text"].startswith(", there was a little girl") and recs["a"]["finish_reason"] == "length"
    assert recs["a"]["completion_tokens"] == 16 and recs["a"]["prompt_tokens"] == 5
    assert "invalid JSON" in recs[bad_line]["error"] and "invalid fields" in recs["c"]["error"]
    assert "." not in recs["d"]["text"]
    assert recs["e"]["completion_tokens"] == 10
    assert "rows=6 errors=2" in r.stdout

    # Resume: take two results out of their shard (as if never committed); a re-run computes
    # exactly those and nothing twice.
    for shard in out.glob("part-*.jsonl"):
        kept = [ln for ln in shard.read_text().splitlines() if json.loads(ln)["id"] not in ("a", "e")]
        shard.write_text("".join(ln + "\n" for ln in kept))
    r = submit(ray_head, *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rows=2 errors=0" in r.stdout and "already_done=4" in r.stdout
    ids = [rec["id"] for rec in read_shards(out)]
    assert sorted(ids) == sorted(["a", "b", bad_line, "c", "d", "e"])
    again = {rec["id"]: rec for rec in read_shards(out)}
    assert again["a"]["text"] == recs["a"]["text"]
