"""The JSON every codec reads (serving/protocols/codec/strict_json.py) and the text fields they share (text.py),
without a server: the edges JSON allows are read, what a hostile body uses is a 400 naming it, the memory budget is
charged before parsing, and no byte string or JSON value gets anything but a value or INVALID_ARGUMENT out."""
from __future__ import annotations

import json
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.core import Code, ServingError
from serving.memory_costs import JSON_VALUE_BYTES
from serving.protocols.codec import strict_json, text

ANY = msgspec.json.Decoder()


def keys(value: object) -> int:
    """The keys of every object in a parsed value (what a codec counts on its typed objects)."""
    if isinstance(value, dict):
        return len(value) + sum(map(keys, value.values()))
    if isinstance(value, list):
        return sum(map(keys, value))
    return 0


def parse(data: bytes) -> object:
    value, document = strict_json.decode(data, ANY, strict_json.no_charge)
    strict_json.check_keys(document, keys(value))
    return value


def invalid_message(function, *args) -> str:
    """The message of the INVALID_ARGUMENT (HTTP 400) ServingError that function(*args) must raise."""
    with pytest.raises(ServingError) as info:
        function(*args)
    assert info.value.code is Code.INVALID_ARGUMENT and info.value.code.http_status == 400
    return info.value.message


@pytest.mark.parametrize("data, value", [(b"[1]", [1]), (b'"s"', "s"), (b' {"a": null} ', {"a": None})])
def test_parse(data, value):
    assert parse(data) == value


@pytest.mark.parametrize("data, message", [(b"", "JSON Parse error: The document is empty$"),
                                           (b"  \n", "JSON Parse error: The document is empty. at offset: 3$"),
                                           (b"{", "JSON Parse error: "), (b"\xff", "JSON Parse error: ")])
def test_parse_rejects(data, message):
    error = invalid_message(parse, data)
    assert error == message[:-1] if message.endswith("$") else error.startswith(message)


@pytest.mark.parametrize("data, value", [
    (b"[" * 64 + b"]" * 64, json.loads("[" * 64 + "]" * 64)),
    (b'["[[[[' + b"[" * 100 + b'"]', ["[[[[" + "[" * 100]),
    (b'["\\"' + b"[" * 100 + b'", {"a": "\\\\"}]', ['"' + "[" * 100, {"a": "\\"}]),
    (b'["\\\\", "' + b"[" * 100 + b'", "\\\\\\"", {"a": 1}]', ["\\", "[" * 100, '\\"', {"a": 1}]),
    (b'["\\ud83d\\ude00", "\\\\ud800"]', ["\U0001F600", "\\ud800"]),
    (b"[1e308, -1.7976931348623157e+308, 1e-999, 1E+2, " + b"9" * 100 + b"]",
     [1e308, -1.7976931348623157e308, 0.0, 100.0, int("9" * 100)]),
    ('{"\u00e9": [1]}'.encode("utf-16"), {"\u00e9": [1]}),
    (b"\xef\xbb\xbf[1]", [1]),
    (b'{"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}', {"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}),
    (b'{"a": "x:y", "b": "{:}"}', {"a": "x:y", "b": "{:}"}),
], ids=["64-deep", "brackets-in-strings", "escaped-quotes", "escaped-backslashes", "surrogate-pair", "number-edges",
        "utf-16", "utf-8-bom", "same-key-in-different-objects", "colons-in-strings"])
def test_parse_accepts_the_edges(data, value):
    assert parse(data) == value


@pytest.mark.parametrize("data, message", [
    (b"[" * 65 + b"]" * 65, "JSON Parse error: arrays and objects nest deeper than the limit of 64 levels"),
    (b"[" * 1_000_000, "JSON Parse error: arrays and objects nest deeper than the limit of 64 levels"),
    (b'["\\"", ' + b"[" * 65 + b"]" * 65 + b"]",
     "JSON Parse error: arrays and objects nest deeper than the limit of 64 levels"),
    (b'{"a": 1, "b": 2, "a": 3}', "JSON Parse error: duplicate key 'a' in an object"),
    (b'[{"x": {"b64": "AP8=", "b64": "AP8="}}]', "JSON Parse error: duplicate key 'b64' in an object"),
    (b"[NaN]", "JSON Parse error: NaN is not a JSON number"),
    (b"[-Infinity]", "JSON Parse error: -Infinity is not a JSON number"),
    (b"[1e309]", "JSON Value error: Number out of range - at `$[0]`"),
    (b"[" + b"9" * 4301 + b"]", "JSON Parse error: a number has more than 100 digits"),
    (b"[0." + b"1" * 101 + b"]", "JSON Parse error: a number has more than 100 digits"),
    (b'["\\ud800"]', "JSON Parse error: a string holds a lone UTF-16 surrogate escape"),
    (b'{"\\udfff": 1}', "JSON Parse error: a string holds a lone UTF-16 surrogate escape"),
    (b'["\\ude00\\ud83d"]', "JSON Parse error: a string holds a lone UTF-16 surrogate escape"),
    (b'["\xed\xa0\x80"]', "JSON Parse error: Invalid encoding in string."),
], ids=["65-deep", "1M-deep", "deep-after-escaped-quote", "duplicate-key", "duplicate-key-nested", "NaN",
        "-Infinity", "float-overflow", "4301-digits", "101-digit-fraction", "lone-surrogate", "lone-surrogate-key",
        "reversed-pair", "utf-8-encoded-surrogate"])
def test_parse_rejects_hostile(data, message):
    assert invalid_message(parse, data).startswith(message)


def test_depth_check_is_fast():
    """Tens of megabytes of brackets are refused in well under a second, not parsed (or recursed into)."""
    started = time.perf_counter()
    assert "nest deeper" in invalid_message(parse, b"[" * (30 << 20))
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize("data, depth", [(b"", 0), (b"[]", 1), (b"[[],[[]]]", 3), (b"[" * 200, 65),
                                         (b"[]" * 1000, 1), (b"[]" * 1000 + b"{[{}]}", 3)])
def test_bracket_depth(data, depth):
    assert min(strict_json.bracket_depth(data), 65) == depth


def test_values_are_charged_before_they_are_parsed():
    """Each value outside strings (a comma each) is charged before msgspec makes it; commas inside strings are not,
    and a charge that raises stops the parse."""
    charged: list[int] = []
    strict_json.decode(b'[1, 2, 3, "a,b,c,d"]', ANY, charged.append)
    assert charged == [4 * JSON_VALUE_BYTES]

    def refuse(nbytes: int) -> None:
        raise ServingError(Code.UNAVAILABLE, "the budget is full")
    with pytest.raises(ServingError) as info:
        strict_json.decode(b"[1, 2]", ANY, refuse)
    assert info.value.code is Code.UNAVAILABLE


@pytest.mark.parametrize("value, finite, text", [
    ({"a": [1.5, 0.1, 1e16]}, True, b'{"a":[1.5,0.1,1e16]}'),
    ([float("nan"), float("inf"), -float("inf")], False, b"[NaN,Infinity,-Infinity]")])
def test_encode(value, finite, text):
    assert strict_json.encode(value, finite) == text


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children,
                                                                                      max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_decode_or_are_invalid_argument(data):
    """Any byte string, or any JSON text Python writes (NaN and Infinity included): a value equal to what the
    standard library reads, or INVALID_ARGUMENT; never any other exception."""
    try:
        value = parse(data)
    except ServingError as error:
        assert error.code is Code.INVALID_ARGUMENT, error
        return
    assert json.dumps(value, sort_keys=True) == json.dumps(json.loads(data), sort_keys=True)


@pytest.mark.parametrize("text_, value", [
    ("0", 0), ("7", 7), ("007", 7), ("123456789012345678901234567890", 123456789012345678901234567890),
    (None, None), ("", None), ("\u00b2", None), ("\u0661\u0662", None), ("\uff11", None), ("-1", None),
    ("+1", None), (" 1", None), ("1 ", None), ("1\n", None), ("1.0", None), ("0x1", None), ("1_000", None),
], ids=repr)
def test_ascii_int(text_, value):
    assert text.ascii_int(text_) == value


@pytest.mark.parametrize("text_, version", [(None, None), ("12", 12), ("007", 7)])
def test_parse_version(text_, version):
    assert text.parse_version(text_) == version


@pytest.mark.parametrize("text_", ["\u00b2", "x", "-3", "1.5", ""], ids=repr)
def test_parse_version_rejects(text_):
    assert invalid_message(text.parse_version, text_) == f"Malformed request: version {text_!r} is not an integer"


@pytest.mark.parametrize("text_, data", [("AP8=", b"\x00\xff"), ("", b""), ("aGk=", b"hi"), ("YWJj", b"abc"),
                                         ("AP8", b"\x00\xff"), ("aGk", b"hi"), ("AP8=\n", b"\x00\xff"),
                                         ("A P\t8\r\n=", b"\x00\xff"), (" ", b"")],
                         ids=["padded", "empty", "two-padding", "no-padding-needed", "unpadded-1", "unpadded-2",
                              "newline", "whitespace-inside", "blank"])
def test_b64decode_reads_base64_as_tf_serving_does(text_, data):
    """absl::Base64Unescape, which TF Serving decodes {"b64"} with, skips whitespace and takes no padding or all."""
    assert text.b64decode(text_, "'b64'") == data


@pytest.mark.parametrize("text_", ["_-8=", "AP8==", "aG==k", "A===", "A", "AP8=AP8=x", "\u00e9"],
                         ids=["url-safe", "too-much-padding", "padding-inside", "padding-of-one-char", "one-char",
                              "trailing", "non-ascii"])
def test_b64decode_rejects_everything_else(text_):
    assert invalid_message(text.b64decode, text_, "'b64'").startswith("Unable to base64 decode 'b64': ")


@pytest.mark.parametrize("value", [b"AP8=", 5, None, ["AP8="]], ids=["bytes", "int", "null", "list"])
def test_b64decode_rejects_non_strings(value):
    assert invalid_message(text.b64decode, value, "input 'x'") == "input 'x' must be a string of standard base64"
