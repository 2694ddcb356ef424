"""``parse_partial`` against the reader the Anthropic SDK's stream helper uses (``jiter``'s partial mode), on every
prefix of JSON texts a tool call's arguments may be."""

import jiter
import pytest

from raypaged.serving.gateway.partial_json import parse_partial

TEXTS = [
    '{"city": "Paris", "n": 12.5, "ok": true, "tags": ["a", "bc"], "o": {"x": null}}',
    '{"q": "a\\"b\\\\c\\u00e9\\n", "e": -1.5e-3, "z": 0, "f": false,'
    ' "l": [[1, 2], [], {"k": [3, {"m": "n"}]}], "E": {}}',
    '{\n  "a" : [ 1 , -0.25E+2 ,"x" ] ,\n "b":{ "c":"d" } }',
    '[1, {"a": "b"}, "c"]',
    '"a string"',
    "-120",
    "true",
]


@pytest.mark.parametrize("text", TEXTS)
def test_every_prefix_reads_as_the_sdk_reads_it(text):
    for end in range(1, len(text) + 1):
        try:
            expected = jiter.from_json(text[:end].encode(), partial_mode=True)
        except ValueError:  # a cut scalar on its own is no value
            with pytest.raises(ValueError):
                parse_partial(text[:end])
            continue
        got = parse_partial(text[:end])
        assert (got, type(got)) == (expected, type(expected)), text[:end]


def test_a_cut_value_is_left_out_with_its_key():
    assert parse_partial('{"zone": "UTC"') == {"zone": "UTC"}
    assert parse_partial('{"zone": "UT') == {}
    assert parse_partial('{"n": 12.') == {}
    assert parse_partial('{"n": [1, {"m": tr') == {"n": [1, {}]}


@pytest.mark.parametrize("text", ["", " ", "{a: 1}", '{"a": 1]', "[1}", "nul1", '{"a": "x\\q"}', "{} {}"])
def test_text_that_is_no_json_prefix_is_an_error(text):
    with pytest.raises(ValueError):
        parse_partial(text)
