"""Offline batch generation on Ray Data: prompt files in, result shards out; streaming,
resumable by id; a bad row becomes an error row and the job goes on.

    python -m cluster batch --input PATH --output DIR [--output-format jsonl|parquet]
                            [--model DIR] [--engines N]

PATH is a JSONL or Parquet file, a folder of them (searched recursively) or a glob, on any
filesystem pyarrow reads (local, s3://, gs://, ...). Each row: {"id": ..., "prompt": "..."} or
{"id": ..., "messages": [...]}, with optional OpenAI-named sampling fields (and `tools`, `tool_choice`
with messages, `echo` with a prompt, vLLM's `prompt_logprobs`). DIR receives shards part-*.jsonl or
part-*.parquet; each row is {"id", "text", "prompt_tokens", "completion_tokens", "cached_tokens",
"finish_reason"} (plus "tool_calls" and "prompt_logprobs" when asked for) or {"id", "error"}. A row with no usable id is named by its
place: "FILE:LINE" (JSONL) or "FILE#ROW" (Parquet). Ids must be unique: the first row read with an
id is run and each later one becomes an error row named by its place. Re-running with the same DIR
skips every id already written (one job per DIR at a time: a running job does not see another's
shards).

The pipeline (Ray Data, streaming, so memory stays bounded whatever the input size):
  read + Preprocess   tasks, each over a share of the files: parse, check the fields, drop ids
                      already written, claim each id (SeenIds: a later row with it is an error),
                      tokenize, check the context; sort spans of --group-rows rows by token ids
                      and cut them into windows of --window rows
  Generate            one actor per engine, hosting an engine.Engine; a window goes to one
                      engine, so rows that share a prefix meet in its radix cache
  WriteShards         an actor; a shard is written under a hidden temporary name and renamed
                      into place (on object stores, uploaded under its final name: an upload is
                      visible only once complete), so only complete shards ever have a final name
The driver sees one small report per shard: progress (rows/s, tokens/s) and the summary."""

from __future__ import annotations

import argparse

from cluster.batch.driver import WINDOWS_PER_ENGINE, BatchOptions, run
from cluster.cli import add_cluster_flags, cluster_config
from openai_api.tool_parsers import TOOL_PARSERS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cluster batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Of the cluster options, the routing, placement, restart, timeout and "
                                        "attention-DP ones do not apply here: windows of rows are dealt to "
                                        "the engines instead of single requests routed.")
    ap.add_argument("--input", required=True, help="JSONL or Parquet: a file, a folder or a glob (any pyarrow URI)")
    ap.add_argument("--output", required=True, help="folder of result shards (ids already there are skipped)")
    ap.add_argument("--output-format", choices=("jsonl", "parquet"), default="jsonl")
    ap.add_argument("--window", type=int, default=128,
                    help=f"rows sent to one engine together; an engine holds {WINDOWS_PER_ENGINE} windows "
                         "at a time (default 128)")
    ap.add_argument("--group-rows", type=int, default=4096,
                    help="rows sorted by token ids together, so that rows sharing a prefix fill the same "
                         "windows and meet in one engine's cache (default 4096)")
    ap.add_argument("--rows-per-shard", type=int, default=1000, help="rows per output shard (default 1000)")
    ap.add_argument("--read-tasks", type=int, default=None,
                    help="concurrent read + tokenize tasks, each over a share of the files (default: max(2, engines))")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                    help="parse tool calls out of rows with tools and tool_choice auto (default: such rows are errors)")
    ap.set_defaults(config_fields=add_cluster_flags(ap))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = BatchOptions(input=args.input, output=args.output, output_format=args.output_format, window=args.window,
                        group_rows=args.group_rows, rows_per_shard=args.rows_per_shard, read_tasks=args.read_tasks,
                        progress=not args.no_progress, tool_call_parser=args.tool_call_parser)
    summary = run(opts, cluster_config(args, *args.config_fields))
    print(summary.line(), flush=True)
    return 0
