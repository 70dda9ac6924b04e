"""The first Ray Data stage, fused into the read tasks: parse, de-duplicate, tokenize and sort rows
into windows (`Preprocess`, `tokenize_rows`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jinja2
import msgspec
import numpy as np
import pyarrow as pa

from cluster.batch.ids import SeenIds, id_digests, place_digests
from cluster.batch.rows import WORK_SCHEMA, BatchLine, lora_name_of, parse_row
from engine.errors import InvalidRequestError
from openai_api.served_model import served_model_name
from openai_api.tool_parsers import parser_for

if TYPE_CHECKING:
    from engine.inputs import InputProcessor


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
                                          limits=cfg.limits, dllm_block_size=model_cfg.dllm_block_size)
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
        adapters = frozenset(self.engine_config.get("lora_paths") or ())
        inputs = self._processor()
        srcs = batch.column("src").to_pylist()
        parsed = [parse_row(raw, src, model_name, self.tool_call_parser, inputs.limits, adapters)
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
        failed, work = tokenize_rows(parsed, inputs, self.tool_call_parser, model_name)
        none = [None] * len(failed)
        return pa.table([[r for r, _ in failed] + [w[1] for w in work], none + [w[0] for w in work],
                         none + [w[2] for w in work], [e for _, e in failed] + [None] * len(work),
                         none + [w[3] for w in work], none + [w[4] for w in work],
                         none + [w[5] for w in work]], schema=WORK_SCHEMA)


def tokenize_rows(parsed: list[tuple[str, BatchLine | None, str | None]], inputs: InputProcessor,
                  tool_call_parser: str | None = None, model_name: str | None = None
                  ) -> tuple[list[tuple[str, str]], list[tuple[list[int], str, bytes, str | None, str | None,
                                                               str | None]]]:
    """Parsed rows -> (error rows as (id, error), work rows as (token ids, id, msgpack params,
    echo prompt, tool parser name, LoRA adapter) in token order). `model_name`: the base model's
    served name (a row's other `model` is an adapter). A row that fails here, its chat template
    included, is an error row of its own: it never fails the window it came in."""
    encoder = msgspec.msgpack.Encoder()
    failed: list[tuple[str, str]] = []
    work: list[tuple[list[int], str, bytes, str | None, str | None, str | None]] = []
    for rid, line, err in parsed:
        if err is None:
            try:
                ids = inputs.tokenize(prompt=line.prompt, messages=line.messages, tools=line.tool_dicts())
                params = line.params()
                inputs.validate_request(len(ids), params)
                parser = parser_for(line.tool_mode, tool_call_parser)
                work.append((ids, rid, encoder.encode(params), line.prompt if line.echo else None,
                             None if parser is None else parser.name,
                             None if model_name is None else lora_name_of(line, model_name)))
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
