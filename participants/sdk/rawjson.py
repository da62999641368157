"""JSON values straight into Arrow (``pyarrow.json``), for sinks with a raw path.

A sink that reads :class:`~twophase.participants.sdk.RawBatch` values itself can hand them to
Arrow's JSON reader in one call instead of decoding each in Python. The reader is not the
runtime's decoder: it accepts some values the runtime refuses (``NaN``, invalid UTF-8), rounds
some it keeps exact (integers past int64), infers types the decoded path does not (timestamps
from ISO strings) and, with inference, misreads a list whose first item is null. These helpers
do the part every such sink needs -- one value per line, one object per value, one row per
value, UTF-8, finite doubles, integers a double holds exactly -- and answer None for any batch
they cannot vouch for, which the sink then gives to its decoded path (every rule, every
rejection reason). Used by the Iceberg sink (an explicit schema) and the files sink (inferred).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

try:
    from twophase_native import flat_columns as _native_flat
    from twophase_native import join_lines as _native_join
except ImportError:  # the compiled extension is optional
    _native_join = None  # type: ignore[assignment]
    _native_flat = None  # type: ignore[assignment]

__all__ = [
    "ARROW_ERRORS",
    "exact_doubles",
    "join_lines",
    "read_flat",
    "read_lines",
    "strings_for_timestamps",
]

#: What Arrow raises for data it cannot read or convert.
ARROW_ERRORS: tuple[type[BaseException], ...] = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    pa.ArrowNotImplementedError,
    OverflowError,
)
#: Every integer of magnitude up to 2**53 is exactly a double; a double at least this large may
#: be an integer the reader rounded (it promotes int64 columns with a float to double, and reads
#: an integer past int64 as a double).
_EXACT_DOUBLE = float(2**53)


def join_lines(values: Sequence[bytes], *, utf8: bool = False) -> bytes | None:
    """The values as one newline-delimited buffer, or None when one value would not be one
    line holding one object (a value with a line break, or that does not start with ``{``),
    or, with ``utf8``, when the buffer is not valid UTF-8 (Arrow does not check it). One pass
    in compiled code when ``twophase_native`` is installed (values of type ``bytes``)."""
    if not values:
        return None
    if _native_join is not None:
        try:
            return _native_join(values, utf8)
        except TypeError:
            pass  # not a sequence of bytes: the same checks in Python
    return _join_lines_py(values, utf8=utf8)


def _join_lines_py(values: Sequence[bytes], *, utf8: bool = False) -> bytes | None:
    data = b"\n".join(values)
    # Exactly the n - 1 line breaks the join put there, each followed by a ``{``: no value
    # holds a line break and every value starts with ``{`` (counted in C, not per value).
    breaks = len(values) - 1
    if data[:1] != b"{" or data.count(b"\n") != breaks or data.count(b"\n{") != breaks:
        return None
    if utf8:
        try:
            data.decode()
        except UnicodeDecodeError:
            return None
    return data


_FLAT_TYPES = {
    "int64": pa.int64(),
    "double": pa.float64(),
    "string": pa.string(),
    "bool": pa.bool_(),
}


def read_flat(values: Sequence[bytes]) -> tuple[dict[str, pa.Array], list[int]] | None:
    """Values that are each one JSON object of scalars, as one Arrow array per top-level field
    (in the order the fields first appear) and the rows that are an empty object -- exactly
    what pyarrow's inference makes of the decoded objects (``pa.array`` of their dicts), read
    in one compiled pass without Arrow's JSON reader. None when ``twophase_native`` is not
    installed or cannot vouch for the batch (a nested value, a repeated key, a field whose
    values Arrow would not put in one type, what ``orjson`` would refuse or read otherwise):
    the caller then takes its other path."""
    if _native_flat is None or not values:
        return None
    try:
        read = _native_flat(values if isinstance(values, list) else list(values))
    except TypeError:
        return None  # not bytes
    if read is None:
        return None
    columns, empty = read
    n = len(values)
    fields: dict[str, pa.Array] = {}
    for name, kind, nulls, validity, data, offsets in columns:
        if kind == "null":
            fields[name] = pa.nulls(n)
            continue
        buffers = [None if validity is None else pa.py_buffer(validity), pa.py_buffer(data)]
        if offsets is not None:
            buffers.insert(1, pa.py_buffer(offsets))
        fields[name] = pa.Array.from_buffers(_FLAT_TYPES[kind], n, buffers, null_count=nulls)
    return fields, empty


def read_lines(
    data: bytes, rows: int, options: pa_json.ParseOptions | None = None
) -> pa.Table | None:
    """``data`` (:func:`join_lines`) read by Arrow in one block on this thread; None when Arrow
    refuses it or finds other than ``rows`` rows (a value holding two objects)."""
    try:
        table = pa_json.read_json(
            pa.py_buffer(data),
            read_options=pa_json.ReadOptions(use_threads=False, block_size=len(data) + 1),
            parse_options=options or pa_json.ParseOptions(),
        )
        # Arrow 26 reads a list holding only nulls (``[null, null]``), or one whose first item
        # is null when inferring, into an array whose offsets point past its items: writing it
        # fails later (a Parquet file refused at prepare, again after every restart). Such a
        # read is no read (the values are decoded) -- unless it is an inferring read the caller
        # repeats with the types given (strings_for_timestamps), which is checked instead.
        explicit = options is not None and options.explicit_schema is not None
        if explicit or strings_for_timestamps(table.schema) is None:
            table.validate(full=True)
    except ARROW_ERRORS:
        return None
    return table if table.num_rows == rows else None


def _leaves(array: Any) -> list[Any]:
    """The primitive arrays under ``array`` (struct children, list items), flattened."""
    out: list[Any] = []
    stack = [array]
    while stack:
        a = stack.pop()
        kind = a.type
        if pa.types.is_struct(kind):
            stack.extend(a.field(i) for i in range(kind.num_fields))
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
            stack.append(a.flatten())
        else:
            out.append(a)
    return out


def exact_doubles(table: pa.Table) -> bool:
    """True when every double in ``table`` (nested too) is finite and smaller than 2**53: no
    ``NaN``/``Infinity`` (not JSON) and no integer the reader may have rounded."""
    for column in table.columns:
        for chunk in column.chunks:
            for leaf in _leaves(chunk):
                if not pa.types.is_floating(leaf.type) or len(leaf) == leaf.null_count:
                    continue
                if not pc.all(pc.is_finite(leaf)).as_py():
                    return False
                if pc.max(pc.abs(leaf)).as_py() >= _EXACT_DOUBLE:
                    return False
    return True


def _without_timestamps(kind: Any) -> Any:
    if pa.types.is_timestamp(kind):
        return pa.string()
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(_without_timestamps(f.type)) for f in kind])
    if pa.types.is_list(kind):
        return pa.list_(kind.value_field.with_type(_without_timestamps(kind.value_type)))
    return kind


def _needs_reread(kind: Any) -> bool:
    if pa.types.is_timestamp(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return True
    if pa.types.is_struct(kind):
        return any(_needs_reread(f.type) for f in kind)
    return False


def strings_for_timestamps(schema: pa.Schema) -> pa.Schema | None:
    """For a schema the reader inferred: the schema to read the same data again with, or None
    when the inferred one is already right. Inference types ISO-looking strings as timestamps
    (the decoded path keeps the text: read them as strings) and mistypes a list whose first
    item is null (``[null, 1]`` reads as ``[1, 0]``; read with the list's type given, it is
    right)."""
    if not any(_needs_reread(f.type) for f in schema):
        return None
    return pa.schema([f.with_type(_without_timestamps(f.type)) for f in schema])
