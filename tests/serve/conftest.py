"""Serve apps shared by the modules of tests/serve.

Starting an app (its engine actors, front end and Serve's wiring) is the serve tests' main cost, so
modules whose tests can run on one app share it: "tiny" (the random Llama, 2 engines, overlap
scheduling, the hermes tool parser), "stories" (the trained stories260K model, 2 engines, an API
key, a small KV pool, coalesced streams) and "slow" (the bench's 50M-parameter model, 1 engine,
the llama3_json tool parser).
Each is deployed when a test first needs it and deleted after the last test of the session that
needs it, so engine actors (1 CPU each) never outnumber ray_local's CPUs; the modules run in an
order that keeps each app's users together. A test on a shared app leaves it serving and idle,
and compares engine counters before and after itself instead of assuming a fresh engine.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import pytest

from tests.serve.helpers import API_KEY, TOOLS_TEMPLATE

HERE = os.path.dirname(os.path.abspath(__file__))
# The modules on shared apps run after the others, in this order: "stories" (streaming,
# openai_api), "slow" (openai_api, tools_echo, hostile_clients), "tiny" (tools_echo to
# structured_outputs); at most three engines at a time.
SHARED_APP_MODULES = ["test_streaming", "test_openai_api", "test_tools_echo", "test_hostile_clients",
                      "test_openai_surface", "test_structured_outputs"]


def pytest_collection_modifyitems(config, items):
    # Reorders only this folder's items, among the places they already hold.
    places = [i for i, item in enumerate(items) if os.path.dirname(str(item.path)) == HERE]

    def rank(item) -> int:
        stem = os.path.splitext(os.path.basename(str(item.path)))[0]
        return SHARED_APP_MODULES.index(stem) + 1 if stem in SHARED_APP_MODULES else 0

    for i, item in zip(places, sorted((items[i] for i in places), key=rank)):
        items[i] = item


class SharedApps:
    """The shared apps by name: deployed on first use, deleted after their last user."""

    def __init__(self, serve_base: str, specs: dict[str, Callable[[], dict]]) -> None:
        self.serve_base, self.specs = serve_base, specs
        self.live: set[str] = set()
        self.last_user: dict[str, str] | None = None

    def get(self, name: str) -> str:
        """The app's URL (/name under the proxy), deploying it if it is not running."""
        from ray import serve

        from deploy.app import build_app

        if name not in self.live:
            serve.run(build_app(self.specs[name]()), name=name, route_prefix=f"/{name}")
            self.live.add(name)
        return f"{self.serve_base}/{name}"

    def delete(self, name: str) -> None:
        from ray import serve

        if name in self.live:
            self.live.discard(name)
            # Without waiting: its replicas stop (each engine drains first) while the next tests
            # run; an app deployed meanwhile waits for the CPUs its engines still hold.
            serve.delete(name, _blocking=False)

    def after(self, item: pytest.Item) -> None:
        """Delete the apps whose last user in the session's order is `item`."""
        if self.last_user is None:
            self.last_user = {}
            for it in item.session.items:
                for name in self.specs:
                    if f"{name}_app" in it.fixturenames:
                        self.last_user[name] = it.nodeid
        for name in list(self.live):
            if self.last_user.get(name) == item.nodeid:
                self.delete(name)


APPS = pytest.StashKey[SharedApps]()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    apps = item.config.stash.get(APPS, None)
    if apps is not None:
        apps.after(item)


@pytest.fixture(scope="session")
def tools_model(model_dirs, tmp_path_factory) -> str:
    """The "llama" checkpoint with a chat template that renders tools and tool turns."""
    path = str(tmp_path_factory.mktemp("tools") / "model")
    shutil.copytree(model_dirs["llama"], path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump({**cfg, "chat_template": TOOLS_TEMPLATE}, f)
    return path


@pytest.fixture(scope="session")
def shared_apps(request, serve_base, model_dirs, tools_model):
    def slow() -> dict:
        from engine.bench import bench_model_path

        return {"model_path": bench_model_path(), "num_engines": 1, "torch_threads_per_engine": 1,
                "served_model_name": "tiny", "tool_call_parser": "llama3_json"}

    apps = SharedApps(serve_base, {
        # overlap scheduling and the hermes parser: what test_structured_outputs and
        # test_tools_echo test; hostile clients and the rest of the surface meet them too.
        "tiny": lambda: {"model_path": tools_model, "num_engines": 2, "served_model_name": "tiny",
                         "enable_overlap_schedule": True, "tool_call_parser": "hermes"},
        # A small KV pool and few rows, so test_openai_api's load test queues; the longest stream
        # interval (1 s), so test_streaming's streams are coalesced; max_body_bytes for the 413.
        "stories": lambda: {"model_path": model_dirs["stories"], "num_engines": 2, "api_key": API_KEY,
                            "max_body_bytes": 65536, "stream_interval_s": 1.0,
                            "engine": {"max_total_tokens": 700, "max_running_requests": 48}},
        # Slow enough that a long request is still running when its client goes away (on the
        # tiny model it could finish before a loaded machine delivered the disconnect); the
        # second tool parser test_tools_echo tests.
        "slow": slow,
    })
    request.config.stash[APPS] = apps
    yield apps
    for name in list(apps.live):
        apps.delete(name)
    del request.config.stash[APPS]


# Module-scoped: a module's own fixtures (clients) build on them. Each is deleted after its last user.
@pytest.fixture(scope="module")
def tiny_app(shared_apps) -> str:
    return shared_apps.get("tiny")


@pytest.fixture(scope="module")
def stories_app(shared_apps, model_dirs) -> str:
    model_dirs["stories"]  # skips without the test data, before deploying anything
    return shared_apps.get("stories")


@pytest.fixture(scope="module")
def slow_app(shared_apps) -> str:
    return shared_apps.get("slow")
