"""twophase's optional compiled hot path: JSON source values -> PostgreSQL binary COPY."""

class CopyEncoder:
    """Encodes JSON objects into binary COPY rows of one table's mapped columns."""

    def __init__(self, columns: list[tuple[str, str, int | None]]) -> None:
        """Per target column, in COPY order: (JSON field, base type, max length).

        ValueError names a type the encoder does not handle."""

    def encode(self, values: list[bytes]) -> tuple[bytes, list[int]]:
        """The complete binary COPY stream of the rows taken (b"" when none), and the
        indices of the values handed back to the Python path."""
