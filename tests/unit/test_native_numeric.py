"""The compiled encoder's JSON float -> numeric against the Python path's rule,
``Decimal(repr(x))``: value and display scale, decoded from the binary COPY it writes.

Shortest round-trip digits are not unique when a double lies exactly halfway between two of
them: Python's repr picks the even digit, Rust's formatter rounds up. The encoder must hand
those values back (found in review: 70368744177664.125 was stored as ...664.13, Python stores
...664.12). Pure: no database, the wire format is decoded here.
"""

from __future__ import annotations

import random
import struct
from decimal import Decimal

import orjson
import twophase_native

HEADER = 19  # signature, flags, header extension length


def numerics(payload: bytes) -> list[tuple[Decimal, int]]:
    """(value, dscale) of each row of a one-column binary COPY stream of numeric."""
    out = []
    i = HEADER
    while True:
        (ncols,) = struct.unpack_from(">h", payload, i)
        i += 2
        if ncols == -1:
            return out
        (length,) = struct.unpack_from(">i", payload, i)
        ndigits, weight, sign, dscale = struct.unpack_from(">hhHH", payload, i + 4)
        groups = struct.unpack_from(f">{ndigits}H", payload, i + 12)
        value = sum((Decimal(g).scaleb(4 * (weight - k)) for k, g in enumerate(groups)), Decimal(0))
        out.append((-value if sign == 0x4000 else value, dscale))
        i += 4 + length


def floats(rng: random.Random, n: int) -> list[float]:
    out: list[float] = []
    while len(out) < n:
        kind = rng.randint(0, 4)
        if kind == 0:
            x = rng.uniform(-1, 1) * 10.0 ** rng.randint(-20, 20)
        elif kind == 1:  # dyadic fractions: where exact ties live
            x = rng.randint(0, 2 ** rng.randint(1, 60)) / 2 ** rng.randint(0, 12)
        elif kind == 2:
            x = round(rng.uniform(0, 1e6), rng.randint(0, 6))
        elif kind == 3:  # any bit pattern
            x = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        else:
            x = rng.randint(0, 2**53) * 2.0 ** rng.randint(-60, 10)
        if x == x and abs(x) != float("inf"):
            out.append(x)
    return out


def test_float_to_numeric_is_decimal_of_repr_or_handed_back() -> None:
    values = [70368744177664.125, 910230031439427.25, 0.125, 1e16, 1e-5, 100.0, -0.0]
    values += floats(random.Random(20261122), 100_000)
    encoder = twophase_native.CopyEncoder([("n", "numeric", None)])
    payload, unsure = encoder.encode([orjson.dumps({"n": x}) for x in values])
    handed_back = set(unsure)
    taken = [x for i, x in enumerate(values) if i not in handed_back]
    got = numerics(payload)
    assert len(got) == len(taken)
    wrong = []
    for x, (value, dscale) in zip(taken, got, strict=True):
        want = Decimal(repr(x))
        if value != want or dscale != max(0, -int(want.as_tuple().exponent)):
            wrong.append((repr(x), str(want), str(value), dscale))
    assert wrong == []
    assert {0, 1} <= handed_back  # the two ties
    assert len(handed_back) < len(values) // 20  # and not much else
