"""The batch job as it was before Ray Data, kept only as the baseline of
`python -m cluster.bench --cases batch` (imported by cluster/bench.py alone)."""

from __future__ import annotations

import asyncio
import json
import time

import jinja2
import msgspec

from cluster.batch import BatchLine, BatchSummary, ResultRow, parse_row
from cluster.config import ClusterConfig
from engine.errors import InvalidRequestError
from openai_api.params import DEFAULT_MAX_TOKENS
from openai_api.served_model import served_model_name


def run_driver_loop(cfg: ClusterConfig, input_path: str, output_path: str, max_in_flight: int = 256,
                    progress: bool = False) -> BatchSummary:
    """The job as it was before Ray Data: one JSONL file read into the driver, every request
    through `Cluster.stream_ids` (its router), one JSONL file out. Kept as the benchmark's
    baseline (`python -m cluster.bench --cases batch`); no resume."""
    from tqdm import tqdm

    from cluster.cluster import Cluster

    t0 = time.monotonic()
    summary = BatchSummary()
    todo: list[tuple[str, BatchLine]] = []
    with open(input_path) as f, open(output_path, "w") as out:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                rid, line, err = parse_row(raw, f"line-{lineno}", served_model_name(cfg.model_path),
                                           limits=cfg.limits)
                if err is None:
                    todo.append((rid, line))
                else:
                    out.write(json.dumps({"id": rid, "error": err}) + "\n")
                    summary.rows += 1
                    summary.errors += 1
        with Cluster(cfg) as cluster, tqdm(total=len(todo), disable=not progress, unit="row") as bar:
            async def one(rid: str, line: BatchLine, gate: asyncio.Semaphore) -> None:
                async with gate:
                    row = ResultRow(id=rid)
                    try:
                        ids = cluster.inputs.tokenize(prompt=line.prompt, messages=line.messages)
                        params = line.sampling_params(DEFAULT_MAX_TOKENS)
                        cluster.inputs.validate_request(len(ids), params)
                        deltas = [d async for d in cluster.stream_ids(ids, params)]
                        last = deltas[-1]
                        row = ResultRow(id=rid, error=last.error) if last.error else ResultRow(
                            id=rid, text="".join(d.text for d in deltas), prompt_tokens=last.prompt_tokens,
                            completion_tokens=last.completion_tokens, cached_tokens=last.cached_tokens,
                            finish_reason=last.finish_reason)
                    except InvalidRequestError as e:
                        row = ResultRow(id=rid, error=str(e))
                    except RecursionError:  # a chat template over deeply nested content
                        row = ResultRow(id=rid, error="request nested too deeply")
                    except jinja2.TemplateError as e:
                        row = ResultRow(id=rid, error=f"chat template failed: {e}")
                    out.write(msgspec.json.encode(row).decode() + "\n")
                    summary.rows += 1
                    summary.errors += row.error is not None
                    summary.prompt_tokens += row.prompt_tokens or 0
                    summary.completion_tokens += row.completion_tokens or 0
                    summary.cached_tokens += row.cached_tokens or 0
                    bar.update(1)

            async def all_rows() -> None:
                gate = asyncio.Semaphore(max_in_flight)
                await asyncio.gather(*(one(rid, line, gate) for rid, line in todo))

            cluster.run(all_rows())
    summary.wall_s = time.monotonic() - t0
    return summary
