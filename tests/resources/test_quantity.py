"""Kubernetes quantities, against the grammar resource.Quantity documents: every string the
grammar makes parses to the value its parts say (computed here with the decimal module,
not the parser's arithmetic), and a string it does not make is refused."""
from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.resources.quantity import (MAX, MAX_DIGITS, MAX_EXPONENT, ceil_milli, ceil_value,
                                     parse_quantity)

# The documented grammar, production by production (plus n and u, which the API server's
# parser takes and its canonical form writes).
BINARY_SI = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
DECIMAL_SI = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
              "": Decimal(1), "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"),
              "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18")}
digits = st.text("0123456789", min_size=1, max_size=12)
number = st.one_of(digits, st.builds(lambda a, b: f"{a}.{b}", digits, digits),
                   digits.map(lambda a: a + "."), digits.map(lambda b: "." + b))
sign = st.sampled_from(["", "+", "-"])
signed_integer = st.builds(lambda s, d: s + d, sign, st.text("0123456789", min_size=1,
                                                              max_size=3))
suffix = st.one_of(st.sampled_from(sorted(BINARY_SI)), st.sampled_from(sorted(DECIMAL_SI)),
                   st.builds(lambda e, n: e + n, st.sampled_from("eE"), signed_integer))
quantity = st.tuples(sign, number, suffix)

GRAMMAR = re.compile(r"([+-]?)([0-9]+|[0-9]+\.[0-9]+|[0-9]+\.|\.[0-9]+)"
                     r"(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?|[eE][+-]?[0-9]+)")


def expected(sign_: str, number_: str, suffix_: str) -> Fraction | None:
    """The value the parts say; None where the quantity is out of range."""
    value = Fraction(Decimal(number_))
    if suffix_ in BINARY_SI:
        value *= BINARY_SI[suffix_]
    elif suffix_ in DECIMAL_SI:
        value *= Fraction(DECIMAL_SI[suffix_])
    else:
        exponent = int(suffix_[1:])
        if value and abs(exponent) > MAX_EXPONENT:
            return None
        value *= Fraction(10) ** exponent
    if value > MAX:
        return None
    return -value if sign_ == "-" else value


@settings(max_examples=2000)
@given(quantity)
def test_every_quantity_of_the_grammar_is_parsed_exactly(parts) -> None:
    text = "".join(parts)
    value = expected(*parts)
    if value is None:
        with pytest.raises(ValueError):
            parse_quantity(text)
    else:
        assert parse_quantity(text) == value, text


@settings(max_examples=3000)
@given(st.text(alphabet="0123456789.+-eEKMGTPiknumx ", max_size=10))
def test_any_text_is_parsed_as_the_grammar_reads_it_or_refused(text) -> None:
    match = GRAMMAR.fullmatch(text)
    value = expected(*match.groups()) if match else None
    if value is None:
        with pytest.raises(ValueError):
            parse_quantity(text)
    else:
        assert parse_quantity(text) == value, text


@pytest.mark.parametrize("text,value", [
    ("500m", Fraction(1, 2)), ("1.5", Fraction(3, 2)), ("1Gi", 2**30), ("1G", 10**9),
    ("1e3", 1000), ("128974848", 128974848), ("129e6", 129_000_000), ("123Mi", 123 * 2**20),
    ("0.1m", Fraction(1, 10_000)), ("100u", Fraction(1, 10_000)), ("+.5Ki", 512),
    ("1.", 1), ("1E", 10**18), ("1E3", 1000), ("-2", -2), ("2.5E-3", Fraction(1, 400)),
    ("0e999999", 0), ("9223372036854775807", MAX)])
def test_the_forms_users_write(text, value) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", [
    "", ".", "abc", "1.5.5", "1 Gi", " 1", "1gi", "1Gb", "1e", "1e1.5", "1KiB", "1k1",
    "--1", "1e+", "9223372036854775808", "8Ei", "1e41", "1" * (MAX_DIGITS + 1), "0x10"])
def test_what_is_not_a_quantity_is_refused_naming_it(text) -> None:
    with pytest.raises(ValueError) as refused:
        parse_quantity(text)
    assert repr(text)[:20].rstrip("'") in str(refused.value)


def test_bare_numbers_read_as_their_text_and_other_types_are_refused() -> None:
    assert parse_quantity(2) == 2 and parse_quantity(0.5) == Fraction(1, 2)
    assert parse_quantity(1e-05) == Fraction(1, 100_000)
    for value in (True, None, [1], float("inf"), float("nan")):
        with pytest.raises(ValueError):
            parse_quantity(value)


def test_rounding_is_kubernetes_value_and_milli_value() -> None:
    assert ceil_milli(parse_quantity("0.1m")) == 1  # MilliValue rounds up
    assert ceil_milli(parse_quantity("1.5")) == 1500
    assert ceil_value(parse_quantity("0.5")) == 1
    assert ceil_value(parse_quantity("1Gi")) == 2**30
