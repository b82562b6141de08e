"""Datasets as the learner takes them: JSON Lines rows, checked by the learner's own rules.

What a row must hold is defined once in C++ (``common/tokenizer/dataset_row.h``) and checked by
the learner's prompt ledger on every submitted line (``learner/prompt_ledger.cc``); this module
is a transcription of both, so that a bad dataset fails here, before any byte is sent, with the
message the learner would send back. The idempotency key is ``grpo submit``'s
(``services/learner_client.cc DatasetContentKey``): the same rows always give the same key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_serve.errors import DatasetError

PathLike = str | os.PathLike[str]

# What the ledger trims from each line before parsing it (prompt_ledger.cc Trim).
_TRIMMED = b" \t\r\n\f\v"
_BOM = b"\xef\xbb\xbf"  # nlohmann's parser skips one at the start of its input
_ROLES = ("system", "user", "assistant", "tool")  # common/tokenizer/chat_template.cc
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass(frozen=True)
class DatasetLines:
    """A dataset as the lines one SubmitDataset upload sends, and a name for the learner's log."""

    lines: list[bytes]
    name: str

    @property
    def total_bytes(self) -> int:
        """What the learner counts against its size limit: each line and its newline."""
        return sum(len(line) + 1 for line in self.lines)


def content_key(lines: Iterable[bytes]) -> str:
    """The default idempotency key: "sha256:" + the SHA-256 of the lines, each prefixed by its
    length as a 64-bit little-endian integer (grpo submit's DatasetContentKey)."""
    h = hashlib.sha256()
    for line in lines:
        h.update(struct.pack("<Q", len(line)))
        h.update(line)
    return "sha256:" + h.hexdigest()


def row_error(row: Any) -> str | None:
    """Why the learner refuses `row` (a parsed JSON value), or None when it takes it.

    common::PromptText: an object with "prompt" (a non-empty string) or "messages" (a non-empty
    array of {"role", "content"} objects with string values, role one of system, user,
    assistant, tool); both are checked when both are present. common::RowCompletionBudget: an
    optional "max_completion_length", a positive integer (one that fits in int64).
    """
    if not isinstance(row, dict):
        return "row is not a JSON object"
    if "prompt" not in row and "messages" not in row:
        return 'needs a "prompt" or "messages" field'
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt:
            return '"prompt" must be a non-empty string'
    roles: list[str] = []
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            return '"messages" must be a non-empty array'
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                return f"{where} must be an object"
            role = m.get("role")
            if not isinstance(role, str) or not role:
                return f'{where} needs a non-empty string "role"'
            if not isinstance(m.get("content"), str):
                return f'{where} needs a string "content"'
            roles.append(role)
    # The chat template checks the roles, also when "prompt" is what is used.
    for i, role in enumerate(roles):
        if role not in _ROLES:
            return f"chat message {i} has role '{role}'; expected system, user, assistant or tool"
    if "max_completion_length" in row:
        budget = row["max_completion_length"]
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget < 2**63:
            return '"max_completion_length" must be a positive integer'
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _lone_surrogate(value: Any) -> bool:
    """True when a string in `value` holds a lone UTF-16 surrogate (an escape like "\\ud800"
    without its pair: Python's parser takes it, nlohmann's refuses it)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if any(0xD800 <= ord(c) <= 0xDFFF for c in v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def parse_line(line: bytes) -> tuple[Any, str | None] | None:
    """None for a blank line (the ledger skips it); else (row, None) for a line the learner
    takes and (None, why) for one it refuses, `why` as the ledger says it."""
    trimmed = line.strip(_TRIMMED)
    if not trimmed:
        return None
    if trimmed.startswith(_BOM):
        trimmed = trimmed[len(_BOM):]
    # nlohmann's lexer takes a NUL byte for the end of its input: what follows one is ignored
    # (a NUL inside a string leaves it unterminated, an error either way).
    trimmed = trimmed.split(b"\0", 1)[0]
    try:
        text = trimmed.decode("utf-8")
        row = json.loads(text, parse_constant=_reject_constant, parse_float=_parse_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"not valid JSON ({e})"
    if _lone_surrogate(row):
        return None, "not valid JSON (a string holds an unpaired UTF-16 surrogate escape)"
    why = row_error(row)
    return (None, why) if why else (row, None)


def validate_lines(lines: list[bytes]) -> int:
    """The number of prompts the learner would store for `lines` (blank lines are skipped);
    DatasetError with the ledger's message for the first line it would refuse."""
    count = 0
    for i, line in enumerate(lines):
        parsed = parse_line(line)
        if parsed is None:
            continue
        _, why = parsed
        if why is not None:
            raise DatasetError(f"dataset line {i + 1}: {why}")
        count += 1
    if count == 0:
        raise DatasetError("dataset has no prompts")
    return count


def split_jsonl(data: bytes) -> list[bytes]:
    """The lines of a JSON Lines file as `grpo submit` reads them (std::getline on '\\n': a
    final newline ends the last line, a '\\r' stays in its line)."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def _json_default(value: Any) -> Any:
    # numpy scalars and arrays (a `datasets` dataset in numpy format) become Python values.
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"a value of type {type(value).__name__} is not JSON")


def row_line(row: Any, index: int) -> bytes:
    """One row as the JSON line sent for it (UTF-8, no newline); DatasetError naming the row
    when it cannot be written as JSON (NaN, a datetime, ...)."""
    try:
        text = json.dumps(row, ensure_ascii=False, allow_nan=False, default=_json_default)
    except (TypeError, ValueError) as e:
        raise DatasetError(f"dataset line {index + 1}: not valid JSON ({e}); convert the value "
                           "first") from e
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate: sent escaped, it is refused as the learner refuses it.
        return json.dumps(row, allow_nan=False, default=_json_default).encode("ascii")


def _rows_lines(rows: Iterable[Any]) -> list[bytes]:
    return [row_line(row, i) for i, row in enumerate(rows)]


def _columnar_lines(rows: Iterable[Any]) -> list[bytes]:
    """Rows of a columnar source (datasets, parquet, pandas): Arrow gives a row that lacks a
    column null there, so a null "prompt" or "messages" means the row has none (a dataset that
    mixes the two keeps working); every other field stays as it is."""

    def row_of(row: Any) -> Any:
        if isinstance(row, Mapping):
            return {k: v for k, v in row.items()
                    if not (v is None and k in ("prompt", "messages"))}
        return row

    return [row_line(row_of(row), i) for i, row in enumerate(rows)]


def _file_lines(path: Path) -> DatasetLines:
    if path.is_dir():
        raise DatasetError(f"{path} is a directory, not a JSON Lines or parquet file")
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DatasetError(f"cannot read {path}: {e.strerror}") from e
        return DatasetLines(split_jsonl(data), str(path))
    if suffix in _PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DatasetError(f"reading {path} needs pyarrow (pip install pyarrow)") from e
        if not path.is_file():
            raise DatasetError(f"cannot read {path}: no such file")
        return DatasetLines(_columnar_lines(pq.read_table(path).to_pylist()), str(path))
    raise DatasetError(f"{path}: not a JSON Lines ({', '.join(_JSONL_SUFFIXES)}) or parquet "
                       f"({', '.join(_PARQUET_SUFFIXES)}) file")


def _is_instance(value: Any, module: str, names: tuple[str, ...]) -> bool:
    """isinstance against a class of `module` when that module is loaded (never imports it)."""
    mod = sys.modules.get(module)
    if mod is None:
        return False
    classes = tuple(c for c in (getattr(mod, n, None) for n in names) if isinstance(c, type))
    return bool(classes) and isinstance(value, classes)


def to_lines(dataset: Any, split: str | None = None) -> DatasetLines:
    """`dataset` as the lines of one upload. It may be

    - a `datasets.Dataset` or `IterableDataset`, or a `DatasetDict` with `split` naming one split;
    - a list (or any iterable) of dicts, or a pandas DataFrame;
    - a path (str or os.PathLike) of a JSON Lines file (sent line for line, so its key is
      ``grpo submit``'s for the same file) or of a parquet file.

    Rows hold "prompt" or "messages" as the learner takes them, plus any fields for reward
    functions (in a columnar source a null "prompt" or "messages" is a missing one).
    DatasetError for anything else.
    """
    if _is_instance(dataset, "datasets", ("DatasetDict", "IterableDatasetDict")):
        names = sorted(dataset.keys())
        splits = ", ".join(names)
        if split is None:
            example = names[0] if names else "train"
            raise DatasetError(f"a DatasetDict: pass one split, e.g. dataset['{example}'] or "
                               f"split='{example}' (its splits: {splits})")
        if split not in dataset:
            raise DatasetError(f"the DatasetDict has no split '{split}' (its splits: {splits})")
        part = dataset[split]
        return DatasetLines(_columnar_lines(part), f"{_dataset_name(part)}[{split}]")
    if split is not None:
        raise DatasetError("split= is for a datasets.DatasetDict")
    if isinstance(dataset, (str, os.PathLike)):
        return _file_lines(Path(dataset))
    if _is_instance(dataset, "datasets", ("Dataset", "IterableDataset")):
        return DatasetLines(_columnar_lines(dataset), _dataset_name(dataset))
    if _is_instance(dataset, "pandas", ("DataFrame",)):
        rows = dataset.to_dict(orient="records")
        return DatasetLines(_columnar_lines(rows), "pandas.DataFrame")
    if isinstance(dataset, (bytes, bytearray)):
        raise DatasetError("a dataset is rows or a path, not bytes (write the JSON Lines to a "
                           "file, or pass the rows)")
    if isinstance(dataset, Mapping):
        raise DatasetError("a dataset is a list of rows; got a single dict (wrap it in a list)")
    if isinstance(dataset, Iterable):
        return DatasetLines(_rows_lines(dataset), type(dataset).__name__)
    raise DatasetError(f"cannot read a dataset from a {type(dataset).__name__}: pass a "
                       "datasets.Dataset, a list of dicts, or a JSON Lines or parquet path")


def _dataset_name(ds: Any) -> str:
    info = getattr(ds, "info", None)
    name = getattr(info, "dataset_name", None)
    return f"datasets:{name}" if name else "datasets.Dataset"


def iter_chunks(lines: list[bytes], chunk_bytes: int) -> Iterator[list[bytes]]:
    """`lines` cut into runs of about `chunk_bytes` (a line is never split; the last run may
    be empty), as SubmitLines cuts its messages."""
    run: list[bytes] = []
    size = 0
    for i, line in enumerate(lines):
        size += len(line) + 1
        run.append(line)
        if size >= chunk_bytes and i + 1 < len(lines):
            yield run
            run, size = [], 0
    yield run
