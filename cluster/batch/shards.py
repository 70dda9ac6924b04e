"""The job's output: a result row (`ResultRow`, `RESULT_SCHEMA`), result shards committed whole
(`WriteShards`, the last Ray Data stage), the committed ones listed (`committed_shards`) and a
killed run's temporaries removed. No engine import: the writer's process starts without torch."""

from __future__ import annotations

import hashlib
import posixpath
from typing import Any

import msgspec
import pyarrow as pa

from cluster.batch.files import filesystem_for

SHARD_PREFIX = "part-"
TMP_SUFFIX = ".tmp"
# pyarrow filesystems (type_name) where an object appears only once its upload completes (S3's
# PutObject / CompleteMultipartUpload, GCS's finalized upload) and a rename is a copy and a delete:
# shards are uploaded under their final names there.
ATOMIC_UPLOAD_FILESYSTEMS = frozenset({"s3", "gcs"})


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


_TOKEN_LOGPROB = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])
RESULT_SCHEMA = pa.schema([
    ("id", pa.string()), ("text", pa.string()), ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
    ("cached_tokens", pa.int64()), ("finish_reason", pa.string()), ("error", pa.string()),
    ("tool_calls", pa.list_(pa.struct([("id", pa.string()), ("type", pa.string()), ("function", pa.struct([
        ("name", pa.string()), ("arguments", pa.string())]))]))),
    ("prompt_logprobs", pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()),
                                            ("rank", pa.int64()), ("top_logprobs", pa.list_(_TOKEN_LOGPROB))])))])


class ShardReport(msgspec.Struct, kw_only=True):
    """What the writer tells the driver about a shard it committed."""

    path: str
    rows: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def committed_shards(output: str) -> list[str]:
    """The complete shards under output (a shard being written has a hidden temporary name)."""
    from pyarrow import fs as pafs

    filesystem, base = filesystem_for(output)
    infos = filesystem.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File
                  and posixpath.basename(i.path).startswith(SHARD_PREFIX)
                  and i.path.endswith((".jsonl", ".parquet")))


def _remove_stale_temporaries(output: str) -> None:
    """Shards a killed run left half-written: never read, removed before the next run writes."""
    from pyarrow import fs as pafs

    filesystem, base = filesystem_for(output)
    filesystem.create_dir(base, recursive=True)
    for info in filesystem.get_file_info(pafs.FileSelector(base)):
        name = posixpath.basename(info.path)
        if name.startswith("." + SHARD_PREFIX) and name.endswith(TMP_SUFFIX):
            filesystem.delete_file(info.path)


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
