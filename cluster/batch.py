"""Offline batch generation: JSONL in, JSONL out; resumable; a bad line never stops the job.

    python -m cluster batch --input prompts.jsonl --output results.jsonl [--model DIR] [--engines N]

Input lines: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}, with optional
OpenAI-named sampling fields. Output lines: {"id", "text", "prompt_tokens",
"completion_tokens", "cached_tokens", "finish_reason"} or {"id", "error"}."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import msgspec
from tqdm import tqdm

from cluster.cli import add_cluster_flags, cluster_config
from cluster.openai_params import OpenAISampling
from engine import InvalidRequestError


class BatchLine(OpenAISampling, kw_only=True, forbid_unknown_fields=True):
    id: str | int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None


DEFAULT_MAX_TOKENS = 256


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cluster batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="JSONL file of requests")
    ap.add_argument("--output", required=True, help="JSONL results (appended; ids already there are skipped)")
    ap.add_argument("--max-in-flight", type=int, default=256, help="requests submitted at once")
    ap.add_argument("--no-progress", action="store_true")
    ap.set_defaults(config_fields=add_cluster_flags(ap))
    return ap


def read_done_ids(path: str) -> set[str]:
    done: set[str] = set()
    if os.path.exists(path):
        with open(path) as f:
            for raw in f:
                try:
                    done.add(str(json.loads(raw)["id"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from an interrupted run: that id runs again
    return done


def parse_line(raw: str, lineno: int) -> tuple[str, BatchLine | None, str | None]:
    """-> (id, parsed line or None, error or None)."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return f"line-{lineno}", None, f"invalid JSON: {e}"
    rid = str(obj.get("id", f"line-{lineno}")) if isinstance(obj, dict) else f"line-{lineno}"
    try:
        line = msgspec.convert(obj, BatchLine)
    except msgspec.ValidationError as e:
        return rid, None, f"invalid fields: {e}"
    if (line.prompt is None) == (line.messages is None):
        return rid, None, "give exactly one of prompt or messages"
    try:
        line.sampling_params(DEFAULT_MAX_TOKENS)
    except InvalidRequestError as e:
        return rid, None, str(e)
    return rid, line, None


async def run_batch(cluster, lines: list[tuple[str, BatchLine]], out, max_in_flight: int, bar) -> None:
    sem = asyncio.Semaphore(max_in_flight)
    t0 = time.monotonic()
    tokens = 0

    async def one(rid: str, line: BatchLine) -> None:
        nonlocal tokens
        async with sem:
            try:
                ids = cluster.inputs.tokenize(prompt=line.prompt, messages=line.messages)
                params = line.sampling_params(DEFAULT_MAX_TOKENS)
                cluster.inputs.validate_request(len(ids), params)
                deltas = [d async for d in cluster.stream_ids(ids, params)]
                text = "".join(d.text for d in deltas)
                last = deltas[-1]
                if last.error:
                    rec = {"id": rid, "error": last.error}
                else:
                    rec = {"id": rid, "text": text, "prompt_tokens": last.prompt_tokens,
                           "completion_tokens": last.completion_tokens, "cached_tokens": last.cached_tokens,
                           "finish_reason": last.finish_reason}
                    tokens += last.completion_tokens
            except InvalidRequestError as e:
                rec = {"id": rid, "error": str(e)}
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
            out.flush()
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / max(time.monotonic() - t0, 1e-9):.1f}")

    await asyncio.gather(*(one(rid, line) for rid, line in lines))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    done = read_done_ids(args.output)
    todo: list[tuple[str, BatchLine]] = []
    bad: list[dict] = []
    with open(args.input) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            rid, line, err = parse_line(raw, lineno)
            if rid in done:
                continue
            if err is not None:
                bad.append({"id": rid, "error": err})
            else:
                todo.append((rid, line))
    with open(args.output, "a") as out:
        for rec in bad:
            out.write(json.dumps(rec) + "\n")
        print(f"batch: {len(todo)} to run, {len(done)} already done, {len(bad)} invalid line(s)", flush=True)
        if not todo:
            return 0
        from cluster import Cluster

        cluster = Cluster(cluster_config(args, *args.config_fields))
        try:
            with tqdm(total=len(todo), disable=args.no_progress, unit="req") as bar:
                cluster.run(run_batch(cluster, todo, out, args.max_in_flight, bar))
        finally:
            cluster.shutdown()
    print(f"batch: wrote {args.output}", flush=True)
    return 0
