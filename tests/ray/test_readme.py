"""The README's recipes, run exactly as written, as a new user would paste them. The batch job's
recipe is also where the job is shown under Ray Jobs (`ray job submit` to a `ray start --head`
cluster with token auth): its prompts have every kind of row, bad ones included. The job's rows,
files and resume are tested without Ray Jobs in tests/ray/test_batch_data.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from kernels.cache import cache_dir
from tests.conftest import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def readme_block(section: str) -> str:
    """The first ```bash block under the README heading that starts with `section`."""
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## " + section)
    return re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)


def repo_copy(dest) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0,
                    reason="needs root, unshare and ip: the recipe's Ray must not meet the test session's")
def test_ray_job_submit_recipe(tmp_path):
    """Fresh HOME (no Ray token yet), the repository as the working directory, the block as
    written. It runs in its own PID and network namespaces, as on a machine of its own: `ray stop`
    stops only the Ray it started, and its default ports (6379, 8265, the job agent's 52365) are
    not the test session's. The job's rows: greedy and sampled, prompt and chat, and two bad rows
    (invalid JSON, named by its place; a field of the wrong type) that become error rows while
    the job goes on; its summary line reaches `ray job submit`'s output."""
    repo, home = tmp_path / "radixray", tmp_path / "home"
    repo.mkdir()
    home.mkdir()
    repo_copy(repo)
    lines = [
        json.dumps({"id": "a", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}),
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8,
                    "temperature": 0.7, "seed": 3}),
        "{not json",
        json.dumps({"id": "c", "prompt": "The cat", "temperature": "hot"}),
        json.dumps({"id": "d", "prompt": "Tom", "max_tokens": 10, "top_p": 0.9, "top_k": 20, "ignore_eos": True}),
    ]
    (repo / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    # The session's cache: the job runs from the working directory Ray unpacked for it, a new path
    # each run, and shares the CPU kernels' build (keyed by the sources' contents) with the checkout.
    env |= {"HOME": str(home), "RADIXRAY_CACHE_DIR": cache_dir()}
    script = "ip link set lo up\nset -euo pipefail\n" + readme_block("Offline batch jobs")
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--net", "bash", "-c", script], cwd=repo,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = {rec["id"]: rec for rec in map(json.loads, (repo / "results.jsonl").read_text().splitlines())}
    bad_line = f"{repo.resolve() / 'prompts.jsonl'}:3"  # no usable id: named by its place ("$PWD/prompts.jsonl")
    assert set(results) == {"a", "b", bad_line, "c", "d"}
    assert all("error" not in results[rid] and "text" in results[rid] for rid in "abd"), results
    # The built-in model's byte-level tokenizer: a token per byte, and the BOS token.
    assert results["a"]["prompt_tokens"] == len(b"Once upon a time") + 1
    assert results["a"]["completion_tokens"] == 16 and results["a"]["finish_reason"] == "length"
    assert 1 <= results["b"]["completion_tokens"] <= 8
    assert results["d"]["completion_tokens"] == 10 and results["d"]["finish_reason"] == "length"
    assert "invalid JSON" in results[bad_line]["error"] and "invalid fields" in results["c"]["error"]
    assert re.search(r"^batch: rows=5 errors=2 .* already_done=0$", r.stdout, re.M), r.stdout[-3000:]
