"""The README's recipes, run exactly as written, as a new user would paste them."""

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
    not the test session's."""
    repo, home = tmp_path / "radixray", tmp_path / "home"
    repo.mkdir()
    home.mkdir()
    repo_copy(repo)
    (repo / "prompts.jsonl").write_text(
        json.dumps({"id": "a", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}) + "\n"
        + json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env |= {"HOME": str(home), "RADIXRAY_CACHE_DIR": cache_dir()}
    script = "ip link set lo up\nset -euo pipefail\n" + readme_block("Offline batch jobs")
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--net", "bash", "-c", script], cwd=repo,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = {rec["id"]: rec for rec in map(json.loads, (repo / "results.jsonl").read_text().splitlines())}
    assert set(results) == {"a", "b"} and all("error" not in rec for rec in results.values())
