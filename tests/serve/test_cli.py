"""The README's main command, run as a user would: `python3 -m cluster serve --engines 2` on the
built-in model (on a free port), its printed curl line, request failures on its console, and a
clean stop on SIGTERM."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT, free_port
from tests.serve.helpers import Console

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def served():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    console = Console([sys.executable, "-m", "cluster", "serve", "--engines", "2", "--port", str(port)], env)
    try:
        console.wait_for("radixray is serving on", timeout_s=300)
        yield console, f"http://127.0.0.1:{port}"
    finally:
        if console.proc.poll() is None:
            os.killpg(console.proc.pid, signal.SIGKILL)


def test_the_printed_curl_line_works(served):
    console, base = served
    curl = next(line for line in console.lines if line.strip().startswith("curl "))
    out = subprocess.run(shlex.split(curl) + ["-s", "-w", "\n%{http_code}"], capture_output=True, text=True,
                         timeout=120)
    body, _, code = out.stdout.rpartition("\n")
    assert code == "200", out.stdout
    assert '"finish_reason"' in body


def test_request_failures_reach_the_console(served):
    console, base = served
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "top_k": 10**30})
    assert r.status_code == 400
    rid = r.headers["x-radixray-request-id"]
    line = console.wait_for(rid, timeout_s=30)
    assert "rejected (400)" in line and "top_k" in line


def test_sigterm_stops_cleanly(served):
    console, _ = served
    console.proc.send_signal(signal.SIGTERM)
    assert console.proc.wait(timeout=120) == 0
    console.wait_for("radixray: shutting down", timeout_s=5)


def test_the_scaling_recipe_parses_and_builds():
    """The README's scale-out command, as written: its flags parse, and the app it describes
    builds (a front-end deployment of 2, an autoscaled engine deployment, the fleet registry)."""
    import re

    from cluster.__main__ import serve_parser
    from cluster.cli import given
    from deploy.app import build_app
    from deploy.options import AppArgs
    from tests.conftest import data_path

    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Scaling out"):]
    line = re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip()
    argv = shlex.split(line)
    assert argv[:4] == ["python3", "-m", "cluster", "serve"]
    argv = [str(data_path("models/stories260K")) if a == "../shared/models/stories260K" else a for a in argv[4:]]
    ap, fields = serve_parser()
    flat = given(ap.parse_args(argv), fields)
    parsed = AppArgs.from_dict(flat)
    assert parsed.fleet.frontends == 2 and (parsed.fleet.min_engines, parsed.fleet.max_engines) == (1, 2)
    app = build_app(flat)
    assert type(app).__name__ == "Application"
