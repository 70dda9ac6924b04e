"""Helpers shared by the Serve test modules (test modules never import each other)."""

from __future__ import annotations

import subprocess
import threading
import time

import httpx
import ray

from cluster.cluster import ACTOR_NAMESPACE
from tests.conftest import ROOT

API_KEY = "sk-test-radixray"  # the shared stories app's key (tests/serve/conftest.py)

# A Qwen-style chat template that renders tools and tool turns (the shared tiny app's model):
# without tools it renders plain messages as the built-in models' template does.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n"
    "{% for c in m['tool_calls'] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>\n'
    "{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Console:
    """A process whose merged stdout/stderr is collected line by line on a thread."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            if self.proc.poll() is not None and not any(text in line for line in self.lines):
                break
            time.sleep(0.2)
        raise AssertionError(f"{text!r} not on the console; it shows:\n" + "\n".join(self.lines[-40:]))


def engines_of(base: str) -> list:
    names = httpx.get(f"{base}/health", timeout=30).json()["engine_actors"]
    return [ray.get_actor(n, namespace=ACTOR_NAMESPACE) for n in names]


def wait_for_engines(base: str, n: int, timeout_s: float = 180.0) -> None:
    """Until every front end routes to exactly n healthy engines (asked a few times: the proxy
    spreads the health checks over the front ends)."""
    deadline = time.monotonic() + timeout_s
    streak = 0
    while streak < 6:
        assert time.monotonic() < deadline, f"the fleet did not settle at {n} engines"
        r = httpx.get(f"{base}/health", timeout=30)
        ok = r.status_code == 200 and len(r.json()["engines"]) == n
        streak = streak + 1 if ok else 0
        time.sleep(0.3)
