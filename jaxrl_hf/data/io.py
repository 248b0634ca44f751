"""Read and write RL datasets as parquet (verl's format) or JSON lines, validating every row."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence

from jaxrl_hf.data.schema import DataFileError, DatasetRowError, validate_row

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}


def _format_of(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    try:
        return FORMATS[ext]
    except KeyError:
        raise DataFileError(f"{path}: unsupported dataset extension {ext!r}; use one of {sorted(FORMATS)}") from None


def iter_jsonl(path: str, *, error_cls: type[Exception] = DatasetRowError, unit: str = "line") -> Iterator[tuple[int, object]]:
    """``(line_number, parsed_json)`` for every non-blank line of a JSON-lines file (1-based numbers); a line
    that is not valid JSON raises ``error_cls("{path}: {unit} N: invalid JSON ...")``."""
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise error_cls(f"{path}: {unit} {line_no}: invalid JSON ({exc.msg} at column {exc.colno})") from None


def read_rows(path: str, *, validate: bool = True) -> list[dict]:
    """All rows of a ``.parquet`` or ``.jsonl`` dataset; with ``validate`` each row is schema-checked.

    Errors name the file and the row (``line N`` for JSON lines, 1-based; ``row N`` for parquet, 0-based).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    fmt = _format_of(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow's errors (ArrowInvalid, OSError, ...) for a bad file
            raise DataFileError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from err
        if not rows:
            raise DataFileError(f"{path}: the file has no rows")
        if validate:
            for i, row in enumerate(rows):
                validate_row(row, source=path, index=i)
        return rows
    rows = []
    for line_no, row in iter_jsonl(path):
        if validate:
            validate_row(row, source=path, index=line_no)
        rows.append(row)
    if not rows:
        raise DataFileError(f"{path}: the file has no rows (it is empty or blank)")
    return rows


def write_rows(rows: Sequence[dict], path: str, *, validate: bool = True) -> str:
    """Write ``rows`` to ``path`` (format from the extension); returns ``path``.

    Rows are validated first (a malformed row is reported by its index and nothing is written).
    """
    fmt = _format_of(path)
    if validate:
        for i, row in enumerate(rows):
            validate_row(row, source=f"rows to write to {path}", index=i)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
    else:
        with open(tmp, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def read_many(paths: str | Iterable[str], *, validate: bool = True) -> list[dict]:
    """Concatenated rows of one or several dataset files (``data.train_files`` may be a list)."""
    if isinstance(paths, str):
        paths = [paths]
    rows: list[dict] = []
    for p in paths:
        rows.extend(read_rows(p, validate=validate))
    return rows
