"""Which rows run: the ids already written (the resume set, read from the committed shards) are
skipped, and each id is run once per job (`SeenIds`: the first row read with it claims it)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np


def id_digests(ids: list[str]) -> np.ndarray:
    """Fixed-width digests of ids: the resume set is a sorted array of these (16 bytes an id)."""
    return np.array([hashlib.blake2b(i.encode(), digest_size=16).digest() for i in ids], dtype="S16")


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
    # Here, not at the top: the SeenIds actor's process imports this module, and these bring the
    # engine (torch) and Ray Data, which it never uses.
    from cluster.batch.files import filesystem_for
    from cluster.batch.shards import committed_shards

    filesystem, _ = filesystem_for(output)
    parts = [id_digests(_shard_ids(filesystem, p)) for p in committed_shards(output)]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype="S16")


def _load_done(output: str) -> tuple[np.ndarray, int]:
    done = load_done_ids(output)
    return done, len(done)


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
