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
import asyncio
import hashlib
import json
import os
import posixpath
import sys
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import jinja2
import msgspec
import numpy as np
import pyarrow as pa
from ray.data.datasource import FileBasedDatasource

from cluster.cli import add_cluster_flags, cluster_config
from cluster.config import ClusterConfig
from engine.errors import ConfigError, InvalidRequestError
from engine.limits import DEFAULT_LIMITS, RequestLimits
from engine.sampling import SamplingParams
from openai_api.params import DEFAULT_MAX_TOKENS, NamedToolChoice, OpenAISampling, OpenAITools, Tool
from openai_api.served_model import served_model_name
from openai_api.tool_parsers import TOOL_PARSERS, JsonArrayToolParser, ToolParser, parser_for

if TYPE_CHECKING:
    from engine.inputs import InputProcessor

INPUT_EXTENSIONS = (".jsonl", ".ndjson", ".json", ".jsonl.gz", ".json.gz", ".parquet")
SHARD_PREFIX = "part-"
TMP_SUFFIX = ".tmp"
# pyarrow filesystems (type_name) where an object appears only once its upload completes (S3's
# PutObject / CompleteMultipartUpload, GCS's finalized upload) and a rename is a copy and a delete:
# shards are uploaded under their final names there.
ATOMIC_UPLOAD_FILESYSTEMS = frozenset({"s3", "gcs"})
READ_CHUNK_BYTES = 1 << 20
ROWS_PER_READ_BLOCK = 4096
# Windows an engine holds at once: enough queued that its batch stays full while one window's
# results travel on, few enough that the windows left are dealt to whichever engine is free.
WINDOWS_PER_ENGINE = 4


class BatchLine(OpenAISampling, OpenAITools, kw_only=True, forbid_unknown_fields=True):
    """One input row."""

    id: str | int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    model: str | None = None  # optional, as in OpenAI requests; must name the model being run
    tools: list[Tool] | None = None  # with messages, as in chat completions
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # with a prompt: the text starts with it

    def params(self) -> SamplingParams:
        """Its SamplingParams (tool_choice "required" or named constrains the output); raises
        InvalidRequestError."""
        self.validate_tools()
        if self.tools is not None and self.messages is None:
            raise InvalidRequestError("tools need messages", "tools")
        if self.echo and self.prompt is None:
            raise InvalidRequestError("echo needs a prompt", "echo")
        return self.constrain_tools(self.sampling_params(DEFAULT_MAX_TOKENS))


def _tool_parser(parser: str | None) -> ToolParser | None:
    """A parser by its name in WORK_SCHEMA's tool_parser column."""
    if parser is None:
        return None
    return JsonArrayToolParser() if parser == JsonArrayToolParser.name else TOOL_PARSERS[parser]()


class ResultRow(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One output row: a result, or {"id", "error"} (unset fields are left out of JSONL)."""

    id: str
    text: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's message.tool_calls
    # With prompt_logprobs: None, then per prompt token {token_id, logprob, rank, top_logprobs}.
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ShardReport(msgspec.Struct, kw_only=True):
    """What the writer tells the driver about a shard it committed."""

    path: str
    rows: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class BatchSummary(msgspec.Struct, kw_only=True):
    """A run's totals (the final summary line)."""

    rows: int = 0  # written by this run, errors included
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    shards: int = 0
    skipped: int = 0  # ids already in the output before this run
    wall_s: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    def add(self, shard: ShardReport) -> None:
        self.rows += shard.rows
        self.errors += shard.errors
        self.prompt_tokens += shard.prompt_tokens
        self.completion_tokens += shard.completion_tokens
        self.cached_tokens += shard.cached_tokens
        self.shards += 1

    def line(self) -> str:
        wall = max(self.wall_s, 1e-9)
        return (f"batch: rows={self.rows} errors={self.errors} prompt_tokens={self.prompt_tokens} "
                f"completion_tokens={self.completion_tokens} prefix_hit_rate={self.prefix_hit_rate:.1%} "
                f"wall={self.wall_s:.1f}s rows/s={self.rows / wall:.1f} tokens/s={self.completion_tokens / wall:.1f} "
                f"shards={self.shards} already_done={self.skipped}")


class BatchOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The job's own options (the engines' come from ClusterConfig)."""

    input: str
    output: str
    output_format: Literal["jsonl", "parquet"] = "jsonl"
    window: int = 128  # rows sent to one engine together
    group_rows: int = 4096  # rows sorted by token ids together, so shared prefixes share windows
    rows_per_shard: int = 1000
    read_tasks: int | None = None  # concurrent read + tokenize tasks (default: max(2, engines))
    progress: bool = True
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None  # for rows with tool_choice "auto"

    def __post_init__(self) -> None:
        if self.output_format not in ("jsonl", "parquet"):
            raise ConfigError(f"output_format must be jsonl or parquet, got {self.output_format!r}")
        for name in ("window", "group_rows", "rows_per_shard", "read_tasks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")


_TOKEN_LOGPROB = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])
RESULT_SCHEMA = pa.schema([
    ("id", pa.string()), ("text", pa.string()), ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
    ("cached_tokens", pa.int64()), ("finish_reason", pa.string()), ("error", pa.string()),
    ("tool_calls", pa.list_(pa.struct([("id", pa.string()), ("type", pa.string()), ("function", pa.struct([
        ("name", pa.string()), ("arguments", pa.string())]))]))),
    ("prompt_logprobs", pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()),
                                            ("rank", pa.int64()), ("top_logprobs", pa.list_(_TOKEN_LOGPROB))])))])
# echo: the text the output starts with; tool_parser: what parses its tool calls (None: plain text).
WORK_SCHEMA = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("params", pa.binary()),
                         ("error", pa.string()), ("echo", pa.string()), ("tool_parser", pa.string())])
RAW_SCHEMA = pa.schema([("src", pa.string()), ("row", pa.string())])


# ---- paths and filesystems --------------------------------------------------------------------
def filesystem_for(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path on it) for a local path or a URI (s3://, gs://, ...)."""
    from pyarrow import fs as pafs

    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    return pafs.FileSystem.from_uri(uri)


def _is_input_file(path: str) -> bool:
    name = posixpath.basename(path)
    return not name.startswith((".", "_")) and name.lower().endswith(INPUT_EXTENSIONS)


def resolve_input(spec: str) -> tuple[list[str], Any]:
    """A file, a folder (searched recursively) or a glob -> (the data files, sorted; filesystem)."""
    import fnmatch

    from pyarrow import fs as pafs

    filesystem, path = filesystem_for(spec)
    parts = path.split("/")
    glob_at = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), None)
    if glob_at is not None:
        base = "/".join(parts[:glob_at]) or "/"
        infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        files = [i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path)]
    else:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.File:
            files = [path]
        elif info.type == pafs.FileType.Directory:
            infos = filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
            files = [i.path for i in infos if i.type == pafs.FileType.File and _is_input_file(i.path)]
        else:
            raise ConfigError(f"--input {spec!r} does not exist")
    if not files:
        raise ConfigError(f"--input {spec!r} matches no JSONL or Parquet file")
    return sorted(files), filesystem


def _is_parquet(path: str) -> bool:
    return path.lower().endswith(".parquet")


def _strip_nulls(value: Any) -> Any:
    """Parquet has a null where a JSON row would leave the field out: drop them, at any depth."""
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value


class PromptFiles(FileBasedDatasource):
    """JSONL and Parquet files -> rows (src, row): src names the line ("path:line") or the row
    ("path#row") for rows without a usable id; row is its JSON text (a Parquet row re-encoded), so
    both formats meet one parser and a line that is not JSON still reaches it."""

    def _open_input_source(self, filesystem: Any, path: str, **open_args: Any) -> Any:
        if _is_parquet(path):  # Parquet needs random access, not a stream
            return filesystem.open_input_file(path)
        return super()._open_input_source(filesystem, path, **open_args)

    def _read_stream(self, f: Any, path: str) -> Iterator[pa.Table]:
        if _is_parquet(path):
            import pyarrow.parquet as pq

            row = 0
            for rb in pq.ParquetFile(f).iter_batches(batch_size=ROWS_PER_READ_BLOCK):
                rows = rb.to_pylist()
                srcs = [f"{path}#{row + i}" for i in range(len(rows))]
                text = [json.dumps(_strip_nulls(r), ensure_ascii=False, default=str) for r in rows]
                row += len(rows)
                yield pa.table([srcs, text], schema=RAW_SCHEMA)
            return
        srcs: list[str] = []
        text: list[str] = []
        lineno, rest = 0, b""
        while True:
            chunk = f.read(READ_CHUNK_BYTES)
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop() if chunk else b""
            for raw in lines:
                lineno += 1
                if raw.strip():
                    srcs.append(f"{path}:{lineno}")
                    text.append(raw.decode("utf-8", errors="replace"))
            if len(srcs) >= ROWS_PER_READ_BLOCK or (not chunk and srcs):
                yield pa.table([srcs, text], schema=RAW_SCHEMA)
                srcs, text = [], []
            if not chunk:
                return


# ---- parsing and validation --------------------------------------------------------------------
def parse_row(raw: str, src: str, model_name: str, tool_call_parser: str | None = None,
              limits: RequestLimits = DEFAULT_LIMITS) -> tuple[str, BatchLine | None, str | None]:
    """-> (id, parsed row or None, error or None). A row with no usable id is named by src.
    `tool_call_parser`: the job's, for rows with tool_choice "auto". A line over
    limits.max_body_bytes is not parsed; the message count and the stop lists are checked before
    they are copied."""
    limit = limits.max_body_bytes
    if len(raw) > limit or (4 * len(raw) > limit and len(raw.encode("utf-8", "surrogatepass")) > limit):
        return src, None, f"a line over {limit} bytes (limit max_body_bytes={limit})"
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return src, None, f"invalid JSON: {e}"
    except RecursionError:
        return src, None, "invalid JSON: nested too deeply"
    rid = src
    if isinstance(obj, dict) and isinstance(obj.get("id"), str | int) and not isinstance(obj.get("id"), bool):
        rid = str(obj["id"])
    try:
        line = msgspec.convert(obj, BatchLine)
    except msgspec.ValidationError as e:
        return rid, None, f"invalid fields: {e}"
    if (line.prompt is None) == (line.messages is None):
        return rid, None, "give exactly one of prompt or messages"
    if line.model is not None and line.model != model_name:
        return rid, None, f"model {line.model!r} does not exist (running {model_name!r})"
    try:
        if line.messages is not None:
            limits.check_messages(len(line.messages))
        limits.check_stops(line.stop, line.stop_token_ids)
        limits.check_grammar(line.params().constraint)
        parser_for(line.tool_mode, tool_call_parser)
    except InvalidRequestError as e:
        return rid, None, str(e)
    return rid, line, None


def id_digests(ids: list[str]) -> np.ndarray:
    """Fixed-width digests of ids: the resume set is a sorted array of these (16 bytes an id)."""
    return np.array([hashlib.blake2b(i.encode(), digest_size=16).digest() for i in ids], dtype="S16")


def committed_shards(output: str) -> list[str]:
    """The complete shards under output (a shard being written has a hidden temporary name)."""
    from pyarrow import fs as pafs

    filesystem, base = filesystem_for(output)
    infos = filesystem.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File
                  and posixpath.basename(i.path).startswith(SHARD_PREFIX)
                  and i.path.endswith((".jsonl", ".parquet")))


class _IdOnly(msgspec.Struct):
    id: str


def _shard_ids(filesystem: Any, path: str) -> list[str]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with filesystem.open_input_file(path) as f:
            return pq.read_table(f, columns=["id"]).column("id").to_pylist()
    decoder = msgspec.json.Decoder(_IdOnly)
    with filesystem.open_input_stream(path) as f:
        return [decoder.decode(line).id for line in f.read().splitlines() if line.strip()]


def load_done_ids(output: str) -> np.ndarray:
    """The sorted digests of every id in the committed shards (runs as a Ray task, so the driver
    never holds them; Preprocess reads the array from the object store without a copy)."""
    filesystem, _ = filesystem_for(output)
    parts = [id_digests(_shard_ids(filesystem, p)) for p in committed_shards(output)]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype="S16")


def _load_done(output: str) -> tuple[np.ndarray, int]:
    done = load_done_ids(output)
    return done, len(done)


def _remove_stale_temporaries(output: str) -> None:
    """Shards a killed run left half-written: never read, removed before the next run writes."""
    from pyarrow import fs as pafs

    filesystem, base = filesystem_for(output)
    filesystem.create_dir(base, recursive=True)
    for info in filesystem.get_file_info(pafs.FileSelector(base)):
        name = posixpath.basename(info.path)
        if name.startswith("." + SHARD_PREFIX) and name.endswith(TMP_SUFFIX):
            filesystem.delete_file(info.path)


def place_digests(places: list[str]) -> np.ndarray:
    """8-byte digests of rows' places ("FILE:LINE", "FILE#ROW"): who claimed an id in SeenIds."""
    return np.array([hashlib.blake2b(p.encode(), digest_size=8).digest() for p in places], dtype="S8")


class SeenIds:
    """The ids this run has read, so that each is run once: the first row read with an id claims
    it, and a later row with it is refused. One actor for the job (Preprocess tasks read in
    parallel, so no task alone sees every id).

    Memory: 24 bytes a distinct id (its 16-byte digest and the 8-byte digest of the claiming
    row's place), in sorted runs, each at least twice the size of the next (so about log2(n) runs
    to search), merged as they fill; the largest merge holds its run twice for a moment. 10 million
    ids: 240 MB in this actor, none of it in the driver. The place makes a claim idempotent: a read
    task that Ray retries reads its rows again, and their claims still hold."""

    def __init__(self) -> None:
        self._ids: list[np.ndarray] = []  # sorted S16 digests, largest run first
        self._owners: list[np.ndarray] = []  # S8 place digests, aligned with _ids

    def __len__(self) -> int:
        return sum(len(run) for run in self._ids)

    def claim(self, ids: np.ndarray, places: np.ndarray) -> np.ndarray:
        """ids: S16 digests, places: S8 digests, one of each a row, in reading order. -> for each
        row, whether it owns its id: the id was new (the first row with it here owns it), or this
        row's place claimed it before."""
        uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        owner = places[first]
        seen = np.zeros(len(uniq), dtype=bool)
        for run, owners in zip(self._ids, self._owners):
            at = np.minimum(np.searchsorted(run, uniq), len(run) - 1)
            hit = run[at] == uniq
            owner[hit] = owners[at[hit]]
            seen |= hit
        self._add(uniq[~seen], owner[~seen])
        return places == owner[inverse.reshape(-1)]

    def _add(self, ids: np.ndarray, owners: np.ndarray) -> None:
        if not len(ids):
            return
        # Merge with the runs it outgrows until the one before it is over twice its size: log2(n)
        # runs to search at most, and each id copied O(log n) times in all.
        while self._ids and len(self._ids[-1]) <= 2 * len(ids):
            run, run_owners = self._ids.pop(), self._owners.pop()
            at = np.searchsorted(run, ids)
            ids, owners = np.insert(run, at, ids), np.insert(run_owners, at, owners)
        self._ids.append(ids)
        self._owners.append(owners)


class Preprocess:
    """Ray Data stage, fused into the read tasks: parse each row and check its fields, drop the
    ids already done, claim the others (a duplicate id becomes an error row named by its place),
    tokenize, and check the prompt against the context and the vocabulary.
    An instance, not a class, so Ray Data runs it in tasks; each task loads the tokenizer once."""

    def __init__(self, engine_config: dict, done_ref: list, window: int, group_rows: int,
                 tool_call_parser: str | None = None, seen_ids: Any = None) -> None:
        self.engine_config, self.window, self.group_rows = engine_config, window, group_rows
        self.tool_call_parser = tool_call_parser
        self.done_ref = done_ref  # [ObjectRef of the sorted digests of the ids already written]
        # A SeenIds actor shared by the job's tasks; None: this instance keeps its own SeenIds
        # (it then sees only the rows it is given).
        self.seen_ids = seen_ids
        self._inputs: Any = None  # built in the task: a tokenizer does not travel

    def _claim(self, ids: np.ndarray, places: np.ndarray) -> np.ndarray:
        import ray

        if self.seen_ids is None:
            self.seen_ids = SeenIds()
        if isinstance(self.seen_ids, SeenIds):
            return self.seen_ids.claim(ids, places)
        return ray.get(self.seen_ids.claim.remote(ids, places))

    def _processor(self) -> Any:
        if self._inputs is None:
            from engine.config import EngineConfig, ModelConfig
            from engine.inputs import InputProcessor
            from engine.tokenizer import Tokenizer

            cfg = EngineConfig.from_kwargs(**self.engine_config)
            model_cfg = ModelConfig.from_dir(cfg.model_path)
            max_ctx = min(cfg.max_context_len or model_cfg.max_position_embeddings,
                          model_cfg.max_position_embeddings)
            # The engine's KV pool is at least the context unless set lower; the engine re-checks.
            pool = cfg.max_total_tokens or max_ctx + 1
            self._inputs = InputProcessor(Tokenizer(cfg.model_path), model_cfg.vocab_size, max_ctx, pool,
                                          limits=cfg.limits)
        return self._inputs

    def __call__(self, block: pa.Table) -> Iterator[pa.Table]:
        # Whole read blocks come in (a batch size would stop Ray Data fusing this into the read);
        # each span of group_rows rows is sorted by token ids and goes out a window at a time, so
        # rows that share a prefix fill the same windows, and a window goes to one engine.
        for start in range(0, block.num_rows, self.group_rows):
            span = self._span(block.slice(start, self.group_rows))
            for at in range(0, span.num_rows, self.window):
                yield span.slice(at, self.window)

    def _span(self, batch: pa.Table) -> pa.Table:
        import ray

        model_name = served_model_name(self.engine_config.get("model_path"))
        inputs = self._processor()
        srcs = batch.column("src").to_pylist()
        parsed = [parse_row(raw, src, model_name, self.tool_call_parser, inputs.limits)
                  for src, raw in zip(srcs, batch.column("row").to_pylist())]
        digests = id_digests([rid for rid, _, _ in parsed])
        done = ray.get(self.done_ref[0])  # a view of the object store's copy
        if len(done) and parsed:
            at = np.minimum(np.searchsorted(done, digests), len(done) - 1)
            fresh = done[at] != digests
            parsed = [p for p, keep in zip(parsed, fresh) if keep]
            srcs = [s for s, keep in zip(srcs, fresh) if keep]
            digests = digests[fresh]
        if parsed:
            # Only the row that owns its id runs under it; another with the same id is named by
            # its place, so no id appears twice in the output (error rows included).
            owns = self._claim(digests, place_digests(srcs))
            parsed = [p if own else (src, None, f"duplicate id {p[0]!r}: ids must be unique; only the "
                                                "first row read with it is run")
                      for p, src, own in zip(parsed, srcs, owns)]
        failed, work = tokenize_rows(parsed, inputs, self.tool_call_parser)
        none = [None] * len(failed)
        return pa.table([[r for r, _ in failed] + [w[1] for w in work], none + [w[0] for w in work],
                         none + [w[2] for w in work], [e for _, e in failed] + [None] * len(work),
                         none + [w[3] for w in work], none + [w[4] for w in work]], schema=WORK_SCHEMA)


def tokenize_rows(parsed: list[tuple[str, BatchLine | None, str | None]], inputs: InputProcessor,
                  tool_call_parser: str | None = None
                  ) -> tuple[list[tuple[str, str]], list[tuple[list[int], str, bytes, str | None, str | None]]]:
    """Parsed rows -> (error rows as (id, error), work rows as (token ids, id, msgpack params,
    echo prompt, tool parser name) in token order). A row that fails here, its chat template
    included, is an error row of its own: it never fails the window it came in."""
    encoder = msgspec.msgpack.Encoder()
    failed: list[tuple[str, str]] = []
    work: list[tuple[list[int], str, bytes, str | None, str | None]] = []
    for rid, line, err in parsed:
        if err is None:
            try:
                ids = inputs.tokenize(prompt=line.prompt, messages=line.messages, tools=line.tool_dicts())
                params = line.params()
                inputs.validate_request(len(ids), params)
                parser = parser_for(line.tool_mode, tool_call_parser)
                work.append((ids, rid, encoder.encode(params), line.prompt if line.echo else None,
                             None if parser is None else parser.name))
                continue
            except InvalidRequestError as e:
                err = str(e)
            except RecursionError:  # a chat template over deeply nested content (tools | tojson)
                err = "request nested too deeply"
            except jinja2.TemplateError as e:  # the tokenizer converts its own; any other template error
                err = f"chat template failed: {e}"
        failed.append((rid, err))
    work.sort(key=lambda w: w[0])
    return failed, work


class Generate:
    """Ray Data stage: one actor per engine, hosting an engine.Engine directly (its loop on a
    background thread). A call is one window, submitted at once in token order; several windows
    are in flight, so the engine's batch never drains between them."""

    def __init__(self, engine_config: dict) -> None:
        from engine import Engine, EngineConfig, SamplingParams
        from engine.logs import log_to_stderr

        log_to_stderr()
        self._params_decoder = msgspec.msgpack.Decoder(SamplingParams)
        self.engine = Engine(EngineConfig.from_kwargs(**engine_config))
        self.engine.on_fatal = self._die
        self.engine.start_loop()

    @staticmethod
    def _die(error: BaseException) -> None:
        # A dead loop cannot resume: exit, so Ray Data restarts the actor and retries its windows
        # (rather than writing engine failures as the rows' results).
        print(f"radixray: batch engine failed ({type(error).__name__}: {error}); exiting",
              file=sys.stderr, flush=True)
        os._exit(1)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        loop = asyncio.get_running_loop()
        ids, errors = batch.column("id").to_pylist(), batch.column("error").to_pylist()
        prompts, params = batch.column("input_ids").to_pylist(), batch.column("params").to_pylist()
        echoes, parsers = batch.column("echo").to_pylist(), batch.column("tool_parser").to_pylist()
        rows: list[ResultRow | None] = [None] * len(ids)
        pending: list[tuple[int, list, asyncio.Future]] = []
        for i, rid in enumerate(ids):  # in token order (Preprocess sorted them)
            if errors[i] is not None:
                rows[i] = ResultRow(id=rid, error=errors[i])
                continue
            deltas: list = []
            done = loop.create_future()

            def sink(delta: Any, deltas: list = deltas, done: asyncio.Future = done) -> None:
                deltas.append(delta)  # engine thread; read only after `done` resolves
                if delta.finish_reason is not None:
                    loop.call_soon_threadsafe(done.set_result, None)

            try:  # own request ids: the engine refuses two in flight with one id
                self.engine.submit(prompts[i], self._params_decoder.decode(params[i]), sink, rid=uuid.uuid4().hex)
            except InvalidRequestError as e:
                rows[i] = ResultRow(id=rid, error=f"invalid request: {e}")
                continue
            pending.append((i, deltas, done))
        await asyncio.gather(*(done for _, _, done in pending))
        for i, deltas, _ in pending:
            try:
                rows[i] = result_row(ids[i], deltas, prompts[i], echoes[i], _tool_parser(parsers[i]))
            except Exception as e:  # one row's output failing fails that row, never its window
                rows[i] = ResultRow(id=ids[i], error=f"output failed: {type(e).__name__}: {e}")
        return pa.Table.from_pylist([msgspec.structs.asdict(r) for r in rows], schema=RESULT_SCHEMA)


def result_row(rid: str, deltas: list, prompt_ids: list[int], echo: str | None = None,
               parser: ToolParser | None = None) -> ResultRow:
    """One request's output row from its engine deltas."""
    last = deltas[-1]
    if last.error:
        return ResultRow(id=rid, error=last.error)
    text, finish, calls = "".join(d.text for d in deltas), last.finish_reason, None
    if parser is not None:
        parsed = parser.parse(text)
        text = parsed.content or ""
        if parsed.tool_calls:
            calls = [c.as_openai() for c in parsed.tool_calls]
            finish = "tool_calls" if finish == "stop" else finish
    plp = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    if plp is not None:
        plp = [None] + [{"token_id": t, "logprob": e.logprob, "rank": e.rank,
                         "top_logprobs": [{"token_id": x, "logprob": v} for x, v in e.top_logprobs]}
                        for t, e in zip(prompt_ids[1:], plp[1:])]
    return ResultRow(id=rid, text=(echo or "") + text, prompt_tokens=last.prompt_tokens,
                     completion_tokens=last.completion_tokens, cached_tokens=last.cached_tokens,
                     finish_reason=finish, tool_calls=calls, prompt_logprobs=plp)


class WriteShards:
    """Ray Data stage (an actor, so no process starts per shard): commit one shard per call and
    report it. A kill leaves no partial shard under a final name, and resume reads final names
    only: on a local (or HDFS) filesystem a shard is written under a hidden temporary name and
    renamed into place (an atomic rename); on an object store it is uploaded under its final name,
    since an upload is visible only once complete and a rename there is a copy and a delete. Its
    name is a digest of its ids: a retried call rewrites the same shard instead of adding a second
    copy of its rows."""

    def __init__(self, output: str, output_format: str) -> None:
        self.filesystem, self.base = filesystem_for(output)
        self.filesystem.create_dir(self.base, recursive=True)
        self.output_format = output_format
        self.encoder = msgspec.json.Encoder()
        self.atomic_upload = self.filesystem.type_name in ATOMIC_UPLOAD_FILESYSTEMS

    def encode(self, batch: pa.Table) -> bytes | pa.Buffer:
        """A shard's whole file. Encoded before anything is opened: pyarrow completes an upload
        when its stream closes, even on the way out of an exception, so a stream that is written
        only once never holds part of a shard."""
        if self.output_format == "parquet":
            import pyarrow.parquet as pq

            sink = pa.BufferOutputStream()
            pq.write_table(batch, sink)
            return sink.getvalue()
        return b"".join(self.encoder.encode(msgspec.convert(row, ResultRow)) + b"\n" for row in batch.to_pylist())

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow.compute as pc

        ids = batch.column("id").to_pylist()
        digest = hashlib.blake2b("\n".join(ids).encode(), digest_size=10).hexdigest()
        name = f"{SHARD_PREFIX}{digest}.{self.output_format}"
        final, tmp = f"{self.base}/{name}", f"{self.base}/.{name}{TMP_SUFFIX}"
        body = self.encode(batch)
        with self.filesystem.open_output_stream(final if self.atomic_upload else tmp) as f:
            f.write(body)
        if not self.atomic_upload:
            self.filesystem.move(tmp, final)
        failed = batch.column("error").is_valid()
        ok = batch.filter(pc.invert(failed))

        def total(col: str) -> int:
            return int(pc.sum(ok.column(col)).as_py() or 0)

        report = ShardReport(path=final, rows=batch.num_rows, errors=int(pc.sum(failed).as_py() or 0),
                             prompt_tokens=total("prompt_tokens"), completion_tokens=total("completion_tokens"),
                             cached_tokens=total("cached_tokens"))
        return pa.Table.from_pylist([msgspec.structs.asdict(report)])


# ---- the job -------------------------------------------------------------------------------------
def _window_blocks(ds: Any, rows: int, compute: Any, remote_args: dict) -> Any:
    """Cut the stream into blocks of at most `rows` rows (Ray Data's streaming repartition), in the
    same tasks as the stage before. `repartition` takes neither a compute strategy nor resources
    (its tasks ask a CPU each, which engines holding every CPU would starve); Ray Data fuses it
    into the stage before only when both match, so they are set to that stage's here."""
    import dataclasses

    ds = ds.repartition(target_num_rows_per_block=rows)
    op = ds._logical_plan.dag
    if not (dataclasses.is_dataclass(op) and isinstance(getattr(op, "ray_remote_args", None), dict)
            and hasattr(op, "compute")):
        raise RuntimeError("Ray Data's StreamingRepartition changed shape; update cluster.batch._window_blocks")
    op.ray_remote_args.update(remote_args)
    object.__setattr__(op, "compute", compute)  # a frozen dataclass: this op is ours, not yet planned
    return ds


def build_dataset(opts: BatchOptions, cfg: ClusterConfig, done_ref: Any, seen_ids: Any = None) -> Any:
    """read -> Preprocess -> windows -> Generate -> WriteShards, as a lazy Ray Data dataset of
    ShardReport rows. seen_ids: the job's SeenIds actor (None: each read task keeps its own, so
    a duplicate id across tasks' files is not caught)."""
    import ray
    import ray.data

    if cfg.dp_attention:
        raise ConfigError("the batch job runs independent engines: dp_attention is not supported")
    files, filesystem = resolve_input(opts.input)
    use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
    device = "cuda" if use_gpu else "cpu"
    engine_config = msgspec.structs.asdict(cfg.engine_config(device))
    # The CPU stages ask no CPU: engines may hold every CPU of a CPU-only cluster, and these are
    # small next to generation. Their concurrency is capped instead; each task reads its share
    # of the files, so a task (one process, one tokenizer) is started at most read_tasks times.
    read_tasks = opts.read_tasks or max(2, cfg.num_engines)
    light, tasks = {"num_cpus": 0}, ray.data.TaskPoolStrategy(size=read_tasks)
    ds = ray.data.read_datasource(PromptFiles(files, filesystem=filesystem), compute=tasks,
                                  override_num_blocks=min(len(files), read_tasks), **light)
    # No batch size: a whole read block per call, which lets Ray Data fuse this into the read.
    ds = ds.map_batches(Preprocess(engine_config, [done_ref], opts.window, opts.group_rows, opts.tool_call_parser,
                                   seen_ids),
                        batch_size=None,
                        batch_format="pyarrow", compute=tasks, **light)
    # One block per window: the engine stage takes a block at a time, so a window is what goes
    # to one engine.
    ds = _window_blocks(ds, opts.window, tasks, light)
    engine_resources = {"num_gpus": 1} if use_gpu else {"num_cpus": cfg.cpus_per_engine}
    # A batch is a window (Ray Data wants a batch size with GPUs; a short window's block may
    # share a call with the next one).
    ds = ds.map_batches(Generate, batch_size=opts.window, batch_format="pyarrow",
                        fn_constructor_kwargs={"engine_config": engine_config},
                        compute=ray.data.ActorPoolStrategy(size=cfg.num_engines,
                                                           max_concurrent_calls_per_actor=WINDOWS_PER_ENGINE,
                                                           max_tasks_in_flight_per_actor=WINDOWS_PER_ENGINE),
                        **engine_resources)
    ds = ds.map_batches(WriteShards, batch_size=opts.rows_per_shard, batch_format="pyarrow",
                        fn_constructor_kwargs={"output": opts.output, "output_format": opts.output_format},
                        compute=ray.data.ActorPoolStrategy(size=1), **light)
    ds.context.enable_progress_bars = False  # the job's own bar counts rows and tokens
    return ds


def run(opts: BatchOptions, cfg: ClusterConfig) -> BatchSummary:
    """Run the job on Ray (cfg.address, $RAY_ADDRESS, else a new local Ray) and summarise it."""
    import ray
    from tqdm import tqdm

    from cluster.cluster import ensure_ray

    owns_ray = ensure_ray(cfg.address)
    try:
        t0 = time.monotonic()
        _remove_stale_temporaries(opts.output)
        if committed_shards(opts.output):
            # The resume set is read by a task while the pipeline starts (nothing waits for it here).
            done_ref, count_ref = ray.remote(_load_done).options(num_cpus=0, num_returns=2).remote(opts.output)
        else:
            done_ref, count_ref = ray.put(np.zeros(0, dtype="S16")), ray.put(0)
        summary = BatchSummary()
        # One claim a span of rows; it asks no CPU, as the read tasks that call it.
        seen_ids = ray.remote(SeenIds).options(num_cpus=0).remote()
        ds = build_dataset(opts, cfg, done_ref, seen_ids)
        with tqdm(disable=not opts.progress, unit="row", dynamic_ncols=True) as bar:
            for row in ds.iter_rows():
                shard = msgspec.convert(row, ShardReport)
                summary.add(shard)
                elapsed = max(time.monotonic() - t0, 1e-9)
                bar.update(shard.rows)
                bar.set_postfix(tok_s=f"{summary.completion_tokens / elapsed:.1f}", errors=summary.errors)
        ray.kill(seen_ids)  # on a cluster this job does not own, its memory goes back now
        summary.wall_s = time.monotonic() - t0
        summary.skipped = ray.get(count_ref)
        return summary
    finally:
        if owns_ray:
            ray.shutdown()


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
