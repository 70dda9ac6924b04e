"""The job's input: a file, a folder or a glob on any pyarrow filesystem -> its JSONL and Parquet
files (`resolve_input`), read as rows (src, row) by a Ray Data datasource (`PromptFiles`)."""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from ray.data.datasource import FileBasedDatasource

INPUT_EXTENSIONS = (".jsonl", ".ndjson", ".json", ".jsonl.gz", ".json.gz", ".parquet")
READ_CHUNK_BYTES = 1 << 20
ROWS_PER_READ_BLOCK = 4096
RAW_SCHEMA = pa.schema([("src", pa.string()), ("row", pa.string())])


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

    # Here, not at the top: the writer imports this module for filesystem_for, and the engine
    # package brings torch.
    from engine.errors import ConfigError

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
