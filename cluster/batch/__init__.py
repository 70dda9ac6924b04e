"""Offline batch generation on Ray Data (`python -m cluster batch`; its --help, from cli.py,
describes the job). One concern a file:

    files.py       the input: files from a path, folder or glob on any pyarrow filesystem, read as rows
    rows.py        an input line (BatchLine, parse_row), the work row, a result row
    ids.py         which rows run: the ids already written (resume) and each id once (SeenIds)
    preprocess.py  stage 1, in the read tasks: parse, de-duplicate, tokenize, sort into windows
    generate.py    stage 2: one actor per engine runs windows on an engine.Engine it hosts
    shards.py      stage 3: result shards committed whole; the committed ones listed
    driver.py      the options, the pipeline and the run that drives it
    cli.py         the command line"""

from cluster.batch.cli import build_parser, main
from cluster.batch.driver import WINDOWS_PER_ENGINE, BatchOptions, BatchSummary, build_dataset, run
from cluster.batch.files import PromptFiles, filesystem_for, resolve_input
from cluster.batch.generate import Generate, result_row
from cluster.batch.ids import SeenIds, id_digests, load_done_ids, place_digests
from cluster.batch.preprocess import Preprocess, tokenize_rows
from cluster.batch.rows import RESULT_SCHEMA, WORK_SCHEMA, BatchLine, ResultRow, parse_row
from cluster.batch.shards import ShardReport, WriteShards, committed_shards

__all__ = [
    "RESULT_SCHEMA", "WINDOWS_PER_ENGINE", "WORK_SCHEMA", "BatchLine", "BatchOptions", "BatchSummary", "Generate",
    "Preprocess", "PromptFiles", "ResultRow", "SeenIds", "ShardReport", "WriteShards", "build_dataset",
    "build_parser", "committed_shards", "filesystem_for", "id_digests", "load_done_ids", "main", "parse_row",
    "place_digests", "resolve_input", "result_row", "run", "tokenize_rows",
]
