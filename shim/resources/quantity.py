"""Kubernetes resource quantities (`500m`, `1.5`, `1Gi`, `1G`, `1e3`, `128974848`), exact.

The grammar is the one resource.Quantity documents:

    <quantity>        ::= <signedNumber><suffix>
    <signedNumber>    ::= <number> | <sign><number>
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedNumber> | "E" <signedNumber>

with what the API server's own parser adds and writes back: `n` and `u` (nano, micro:
a canonical quantity may end in them) and an integer exponent only. No quantity exceeds
2^63-1 in magnitude; here none has more than 80 significant digits, nor a non-zero one an
exponent beyond 40 either way. Values are Fractions; Kubernetes rounds them up where it
needs integers (`Quantity.Value()`, `MilliValue()`), as `ceil_value` and `ceil_milli` do."""
from __future__ import annotations

import math
import re
from fractions import Fraction

MAX = (1 << 63) - 1

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
           "Ei": 1 << 60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
            "": Fraction(1), "k": Fraction(10**3), "M": Fraction(10**6),
            "G": Fraction(10**9), "T": Fraction(10**12), "P": Fraction(10**15),
            "E": Fraction(10**18)}
_QUANTITY = re.compile(r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
                       r"(?:(?P<unit>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])"
                       r"|[eE](?P<exp>[+-]?[0-9]+))?")
MAX_EXPONENT = 40
MAX_DIGITS = 80
"""Beyond these a quantity is absurd (the API server rounds every one to 1n, caps it at
2^63-1): refused before computing, rather than computed at any cost."""


def parse_quantity(value: str | int | float) -> Fraction:
    """The exact value of a quantity; ValueError naming the value and the forms allowed.
    A bare number (as YAML gives `cpu: 2`) is read like its decimal text."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{value!r} is not a quantity (a string like 500m, 1.5, 1Gi, 1e3)")
    text = value if isinstance(value, str) else repr(value)
    match = _QUANTITY.fullmatch(text)
    if match is None or not (match["int"] or match["frac"]):
        raise ValueError(f"{text!r} is not a Kubernetes quantity (a number with an optional "
                         f"suffix: 500m, 1.5, 1Gi, 1G, 1e3, 128974848)")
    whole, fraction = match["int"].lstrip("0"), (match["frac"] or "").rstrip("0")
    if len(whole) + len(fraction) > MAX_DIGITS:
        raise ValueError(f"{text!r} has more than {MAX_DIGITS} significant digits")
    number = Fraction(int(whole + fraction or "0"), 10 ** len(fraction))
    if match["exp"] is not None:
        exponent = int(match["exp"])
        if number and abs(exponent) > MAX_EXPONENT:
            raise ValueError(f"{text!r}: exponent {exponent} is out of range (at most "
                             f"{MAX_EXPONENT} either way)")
        number *= Fraction(10) ** (exponent if number else 0)
    elif match["unit"] in _BINARY:
        number *= _BINARY[match["unit"]]
    else:
        number *= _DECIMAL[match["unit"] or ""]
    if number > MAX:
        raise ValueError(f"{text!r} is larger than a Kubernetes quantity can be (2^63-1)")
    return -number if match["sign"] == "-" else number


def ceil_value(value: Fraction) -> int:
    """Quantity.Value(): whole units, rounded up (bytes of memory)."""
    return math.ceil(value)


def ceil_milli(value: Fraction) -> int:
    """Quantity.MilliValue(): thousandths, rounded up (millicores of CPU)."""
    return math.ceil(value * 1000)
