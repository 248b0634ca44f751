"""`Batch`: the one container that flows between roles (HybridFlow §2.4; verl's ``DataProto``).

A `Batch` holds

* ``arrays``  — numeric numpy arrays sharing a leading batch dimension (token ids, masks, logprobs);
* ``objects`` — numpy ``dtype=object`` arrays of per-sample Python values (prompt strings, ground
  truths, data sources), same leading dimension;
* ``meta_info`` — a dict of batch-level values (temperature, global step, metrics).

Only numpy buffers and small Python objects are stored, so Ray serialises a `Batch` with pickle
protocol 5: every numeric array travels out of band through the object store and is deserialised
zero-copy (read-only) on the same node. Operations never mutate an input array in place; they either
return views or new arrays.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# meta_info key set by the DP protocols on every dispatched chunk: the number of trailing rows of the
# chunk that are padding (copies of real rows added so the batch divides by the data-parallel size).
PAD_ROWS_KEY = "pad_rows"


def _as_column(key: str, value: Any) -> tuple[str, np.ndarray]:
    """Classify one input value as a numeric array column or an object column."""
    if hasattr(value, "addressable_shards") and not getattr(value, "is_fully_addressable", True):
        raise ValueError(
            f"Batch column {key!r} is a jax.Array that is not fully addressable from this process; "
            "pass the process-local rows (e.g. jax.experimental.multihost_utils.process_allgather "
            "or the addressable shards) instead"
        )
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (list, tuple)):
        items = list(value)
        if items and all(isinstance(v, (bool, int, float, np.number)) for v in items):
            array = np.asarray(items)
        else:  # element-wise fill: nested lists stay per-sample objects, never become 2-D
            array = np.empty(len(items), dtype=object)
            for i, item in enumerate(items):
                array[i] = item
    else:
        array = np.asarray(value)
    if array.ndim == 0:
        raise ValueError(
            f"Batch column {key!r} is a scalar; per-batch scalars belong in meta_info, columns need a "
            "leading batch dimension"
        )
    kind = "objects" if array.dtype == object or array.dtype.kind in "USO" else "arrays"
    if kind == "objects" and array.dtype != object:
        array = array.astype(object)
    return kind, array


def _values_equal(a: Any, b: Any) -> bool:
    """Equality that works for numpy arrays, nested containers and plain values."""
    if a is b:
        return True
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except Exception:  # noqa: BLE001 - incomparable values are unequal
            return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


@dataclass(eq=False)  # element-wise array equality has no single truth value
class Batch:
    """Per-sample arrays and objects with one leading batch dimension, plus batch-level meta info."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    objects: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        overlap = set(self.arrays) & set(self.objects)
        if overlap:
            raise ValueError(f"Batch keys {sorted(overlap)} appear both as arrays and as objects")
        lengths = {k: len(v) for k, v in {**self.arrays, **self.objects}.items()}
        for key, value in self.arrays.items():
            if not isinstance(value, np.ndarray) or value.ndim == 0:
                raise TypeError(f"Batch array {key!r} must be a numpy array with a batch dimension")
        for key, value in self.objects.items():
            if not isinstance(value, np.ndarray) or value.dtype != object or value.ndim == 0:
                raise TypeError(f"Batch object column {key!r} must be a numpy object array")
        if len(set(lengths.values())) > 1:
            raise ValueError(f"Batch columns have different lengths: {lengths}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None) -> Batch:
        """Build a Batch from ``{key: column}``; numeric columns become arrays, others object arrays.

        Lists of strings/dicts become object columns; jax arrays are copied to host with
        ``np.asarray``. Columns must share the leading dimension (the error lists all lengths).
        """
        arrays: dict[str, np.ndarray] = {}
        objects: dict[str, np.ndarray] = {}
        for key, value in data.items():
            kind, column = _as_column(key, value)
            (arrays if kind == "arrays" else objects)[key] = column
        return cls(arrays, objects, dict(meta_info or {}))

    # ------------------------------------------------------------------ inspection
    def __len__(self) -> int:
        for column in (*self.arrays.values(), *self.objects.values()):
            return len(column)
        return 0

    def keys(self) -> list[str]:
        """All column names (arrays first, then objects)."""
        return [*self.arrays, *self.objects]

    def __contains__(self, key: object) -> bool:
        return key in self.arrays or key in self.objects

    def __getitem__(self, item: str | int | slice | Sequence[int] | np.ndarray) -> Any:
        """``batch["key"]`` returns a column; an int, slice or index array returns a row Batch."""
        if isinstance(item, str):
            if item in self.arrays:
                return self.arrays[item]
            if item in self.objects:
                return self.objects[item]
            raise KeyError(f"Batch has no column {item!r}; columns: {self.keys()}")
        if isinstance(item, (int, np.integer)):
            index = int(item)
            if not -len(self) <= index < len(self):
                raise IndexError(f"row {index} out of range for a Batch of length {len(self)}")
            return self.take(np.array([index % len(self)]))
        if isinstance(item, slice):
            return self._map(lambda column: column[item])
        return self.take(np.asarray(item))

    def row(self, index: int) -> dict[str, Any]:
        """One sample as ``{key: value}``."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for a Batch of length {len(self)}")
        return {key: column[index] for key, column in self.to_dict().items()}

    @property
    def nbytes(self) -> int:
        """Bytes held by the numeric arrays (object columns are not counted)."""
        return int(sum(a.nbytes for a in self.arrays.values()))

    def __repr__(self) -> str:
        arrays = {k: (v.shape, str(v.dtype)) for k, v in self.arrays.items()}
        return (
            f"Batch(len={len(self)}, arrays={arrays}, objects={list(self.objects)}, "
            f"meta_info={list(self.meta_info)})"
        )

    def to_dict(self) -> dict[str, np.ndarray]:
        """All columns as one dict (meta_info is not included)."""
        return {**self.arrays, **self.objects}

    # ------------------------------------------------------------------ row operations
    def _map(self, fn: Any, meta_info: dict[str, Any] | None = None) -> Batch:
        return Batch(
            {k: fn(v) for k, v in self.arrays.items()},
            {k: fn(v) for k, v in self.objects.items()},
            dict(self.meta_info if meta_info is None else meta_info),
        )

    def take(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """Rows at ``indices`` (any integer index array, repeats allowed) or a boolean mask."""
        index = np.asarray(indices)
        if index.dtype == bool:
            if index.shape != (len(self),):
                raise ValueError(f"boolean mask of shape {index.shape} for a Batch of length {len(self)}")
            index = np.flatnonzero(index)
        if index.ndim != 1 or (index.size and index.dtype.kind not in "iu"):
            raise ValueError(f"row indices must be a 1-D integer array, got {index.dtype} {index.shape}")
        if index.size and (index.min() < -len(self) or index.max() >= len(self)):
            raise IndexError(f"row index out of range for a Batch of length {len(self)}")
        return self._map(lambda column: column[index])

    def reorder(self, permutation: Sequence[int] | np.ndarray) -> Batch:
        """Rows permuted: ``out[i] = self[permutation[i]]``; ``permutation`` must be a permutation."""
        perm = np.asarray(permutation)
        if perm.shape != (len(self),) or not np.array_equal(np.sort(perm), np.arange(len(self))):
            raise ValueError(
                f"reorder needs a permutation of range({len(self)}), got {perm.tolist()[:16]}"
                f"{'...' if perm.size > 16 else ''}; use take() for arbitrary row selection"
            )
        return self.take(perm)

    def repeat(self, times: int, interleave: bool = True) -> Batch:
        """Each row ``times`` times: interleaved ``[a,a,b,b]`` or tiled ``[a,b,a,b]``."""
        if not isinstance(times, (int, np.integer)) or times < 1:
            raise ValueError(f"repeat times must be a positive int, got {times!r}")
        if interleave:
            return self._map(lambda column: np.repeat(column, times, axis=0))
        return self._map(lambda column: np.concatenate([column] * times, axis=0))

    def chunk(self, num_chunks: int) -> list[Batch]:
        """``num_chunks`` equal contiguous pieces; the length must divide (see `pad_to_divisor`)."""
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        if len(self) % num_chunks:
            raise ValueError(
                f"cannot chunk a Batch of length {len(self)} into {num_chunks} equal pieces; "
                "call pad_to_divisor first"
            )
        size = len(self) // num_chunks
        return [self[i * size : (i + 1) * size] for i in range(num_chunks)]

    def split(self, size: int) -> list[Batch]:
        """Contiguous pieces of ``size`` rows (the last may be shorter)."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self[start : start + size] for start in range(0, len(self), size)] or [self]

    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Append copies of the first rows (cyclically) until ``len % divisor == 0``.

        Returns ``(padded, pad_rows)``; `unpad(pad_rows)` undoes it. Padding rows are real samples, so
        a model can process them; their outputs must be dropped.
        """
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        pad_rows = (-len(self)) % divisor
        if pad_rows == 0:
            return self, 0
        if len(self) == 0:
            raise ValueError("cannot pad an empty Batch: there is no row to copy")
        return Batch.concat([self, self.take(np.arange(pad_rows) % len(self))]), pad_rows

    def unpad(self, pad_rows: int) -> Batch:
        """Drop the last ``pad_rows`` rows."""
        if not 0 <= pad_rows <= len(self):
            raise ValueError(f"cannot drop {pad_rows} padding rows from a Batch of length {len(self)}")
        return self[: len(self) - pad_rows]

    # ------------------------------------------------------------------ column operations
    def select(self, keys: Iterable[str] | None = None, meta_keys: Iterable[str] | None = None) -> Batch:
        """A Batch with only ``keys`` (all if None) and ``meta_keys`` (all if None); no copies."""
        keys = self.keys() if keys is None else list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no columns {missing}; columns: {self.keys()}")
        meta_keys = list(self.meta_info) if meta_keys is None else list(meta_keys)
        missing_meta = [k for k in meta_keys if k not in self.meta_info]
        if missing_meta:
            raise KeyError(f"meta_info has no keys {missing_meta}; keys: {list(self.meta_info)}")
        return Batch(
            {k: self.arrays[k] for k in keys if k in self.arrays},
            {k: self.objects[k] for k in keys if k in self.objects},
            {k: self.meta_info[k] for k in meta_keys},
        )

    def pop(self, keys: Iterable[str], meta_keys: Iterable[str] = ()) -> Batch:
        """Remove ``keys`` (and ``meta_keys``) from this Batch and return them as a new Batch."""
        popped = self.select(keys, meta_keys)
        for key in popped.keys():
            self.arrays.pop(key, None)
            self.objects.pop(key, None)
        for key in popped.meta_info:
            del self.meta_info[key]
        return popped

    def union(self, other: Batch) -> Batch:
        """Columns and meta info of both; shared keys must hold equal values (else ValueError)."""
        if not isinstance(other, Batch):
            raise TypeError(f"union expects a Batch, got {type(other).__name__}")
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"cannot union Batches of lengths {len(self)} and {len(other)}")
        merged = Batch(dict(self.arrays), dict(self.objects), dict(self.meta_info))
        for key, column in other.to_dict().items():
            if key in merged and not _values_equal(merged[key], column):
                raise ValueError(f"union conflict: column {key!r} differs between the two Batches")
            if key in merged.arrays or key in merged.objects:
                continue
            (merged.objects if column.dtype == object else merged.arrays)[key] = column
        for key, value in other.meta_info.items():
            if key in merged.meta_info and not _values_equal(merged.meta_info[key], value):
                raise ValueError(f"union conflict: meta_info[{key!r}] differs between the two Batches")
            merged.meta_info[key] = value
        merged.__post_init__()
        return merged

    @staticmethod
    def concat(batches: Sequence[Batch], meta_conflict: str = "error") -> Batch:
        """Rows of all ``batches`` in order; all must have the same columns.

        meta_info is merged; a key with different values raises unless ``meta_conflict="first"``
        (keep the first batch's value).
        """
        if meta_conflict not in ("error", "first"):
            raise ValueError(f"meta_conflict must be 'error' or 'first', got {meta_conflict!r}")
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one Batch")
        for i, batch in enumerate(batches):
            if not isinstance(batch, Batch):
                raise TypeError(f"concat item {i} is a {type(batch).__name__}, not a Batch")
        first = batches[0]
        for i, batch in enumerate(batches[1:], start=1):
            if set(batch.arrays) != set(first.arrays) or set(batch.objects) != set(first.objects):
                raise ValueError(
                    f"concat: Batch {i} has columns {sorted(batch.keys())}, Batch 0 has "
                    f"{sorted(first.keys())}"
                )
        meta: dict[str, Any] = {}
        for i, batch in enumerate(batches):
            for key, value in batch.meta_info.items():
                if key not in meta:
                    meta[key] = value
                elif meta_conflict == "error" and not _values_equal(meta[key], value):
                    raise ValueError(
                        f"concat: meta_info[{key!r}] differs between Batch 0 and Batch {i}; pass "
                        "meta_conflict='first' or return per-rank values through DP_COMPUTE_METRIC"
                    )
        if len(batches) == 1:
            return Batch(dict(first.arrays), dict(first.objects), meta)
        arrays = {}
        for key in first.arrays:
            try:
                arrays[key] = np.concatenate([b.arrays[key] for b in batches], axis=0)
            except ValueError as err:
                shapes = [b.arrays[key].shape for b in batches]
                raise ValueError(f"concat: column {key!r} has incompatible shapes {shapes}") from err
        objects = {k: np.concatenate([b.objects[k] for b in batches], axis=0) for k in first.objects}
        return Batch(arrays, objects, meta)

    def copy(self) -> Batch:
        """Deep copy of the columns (makes zero-copy, read-only arrays from Ray writable)."""
        return Batch(
            {k: v.copy() for k, v in self.arrays.items()},
            {k: v.copy() for k, v in self.objects.items()},
            dict(self.meta_info),
        )
