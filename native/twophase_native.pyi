"""twophase's optional compiled hot path: JSON and Avro source values -> PostgreSQL binary COPY."""

class CopyEncoder:
    """Encodes JSON objects into binary COPY rows of one table's mapped columns."""

    def __init__(
        self,
        columns: list[tuple[str, str, int | None]],
        row_in: str | None = None,
        ops: list[str] | None = None,
        seq: bool = False,
    ) -> None:
        """Per target column, in COPY order: (JSON field, base type, max length).

        ``row_in`` and ``ops``: the values are change events whose row is the object in member
        ``row_in``, taken when member ``op`` is one of ``ops``. ``seq``: each row starts with
        its value's index (int8) and false (bool).

        ValueError names a type the encoder does not handle."""

    def encode(
        self, values: list[bytes], keys: list[bytes | None] | None = None
    ) -> tuple[bytes, list[int]]:
        """The complete binary COPY stream of the rows taken (b"" when none), and the
        indices of the values handed back to the Python path. With ``keys`` (the record keys,
        JSON objects), a value is taken only when every key member that feeds a column
        equals the row's."""

class AvroCopyEncoder:
    """Encodes values in the schema registry's Avro framing into binary COPY rows."""

    def __init__(self, columns: list[tuple[str, str, int | None]]) -> None:
        """Per target column, in COPY order: (Avro field, base type, max length).

        ValueError names a type the encoder does not handle."""

    def add_schema(self, id: int, schema: str) -> None:
        """Learn the writer schema (Avro JSON, no references) of schema id ``id``; ValueError
        when it cannot be parsed or is not a record."""

    def knows(self, id: int) -> bool:
        """Whether the writer schema of ``id`` was given."""

    def encode(self, values: list[bytes]) -> tuple[bytes, list[int]]:
        """The complete binary COPY stream of the rows taken (b"" when none), and the
        indices of the values handed back to the Python path (any schema not given)."""
