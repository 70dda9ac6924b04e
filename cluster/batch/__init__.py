"""Offline batch generation on Ray Data (`python -m cluster batch`; its --help, from cli.py,
describes the job). One concern a file:

    files.py       the input: files from a path, folder or glob on any pyarrow filesystem, read as rows
    rows.py        an input line (BatchLine, parse_row), the work row
    ids.py         which rows run: the ids already written (resume) and each id once (SeenIds)
    preprocess.py  stage 1, in the read tasks: parse, de-duplicate, tokenize, sort into windows
    generate.py    stage 2: one actor per engine runs windows on an engine.Engine it hosts
    shards.py      stage 3: a result row; result shards committed whole; the committed ones listed
    driver.py      the options, the pipeline and the run that drives it
    cli.py         the command line"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.batch.cli import build_parser, main
    from cluster.batch.driver import (
        WINDOWS_PER_ENGINE,
        BatchOptions,
        BatchSummary,
        build_dataset,
        run,
    )
    from cluster.batch.files import PromptFiles, filesystem_for, resolve_input
    from cluster.batch.generate import Generate, result_row
    from cluster.batch.ids import SeenIds, id_digests, load_done_ids, place_digests
    from cluster.batch.preprocess import Preprocess, tokenize_rows
    from cluster.batch.rows import WORK_SCHEMA, BatchLine, parse_row
    from cluster.batch.shards import (
        RESULT_SCHEMA,
        ResultRow,
        ShardReport,
        WriteShards,
        committed_shards,
    )

# The public names, each from its module on first use: a Ray process that unpickles one stage
# (the SeenIds actor) imports that stage's module, not the engine and Ray Data with the rest.
_MODULES = {
    "cli": ("build_parser", "main"),
    "driver": ("WINDOWS_PER_ENGINE", "BatchOptions", "BatchSummary", "build_dataset", "run"),
    "files": ("PromptFiles", "filesystem_for", "resolve_input"),
    "generate": ("Generate", "result_row"),
    "ids": ("SeenIds", "id_digests", "load_done_ids", "place_digests"),
    "preprocess": ("Preprocess", "tokenize_rows"),
    "rows": ("WORK_SCHEMA", "BatchLine", "parse_row"),
    "shards": ("RESULT_SCHEMA", "ResultRow", "ShardReport", "WriteShards", "committed_shards"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "RESULT_SCHEMA", "WINDOWS_PER_ENGINE", "WORK_SCHEMA", "BatchLine", "BatchOptions", "BatchSummary", "Generate",
    "Preprocess", "PromptFiles", "ResultRow", "SeenIds", "ShardReport", "WriteShards", "build_dataset",
    "build_parser", "committed_shards", "filesystem_for", "id_digests", "load_done_ids", "main", "parse_row",
    "place_digests", "resolve_input", "result_row", "run", "tokenize_rows",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
