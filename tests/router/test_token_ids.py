"""router.token_ids and the fast JSON paths answer exactly what the plain Python loops answer."""

from __future__ import annotations

import json

import pytest

from router.body import load_json_object
from router.errors import BadRequest
from router.proxy import encode_body
from router.token_ids import all_ints, as_uint32, min_max

CASES = [[], [0], [3, 1, 2], [True, 1], [1, 1.0], [1, "2"], [None], [-5, 3], [2**40, 1], [2**70, 7], [-(2**70)]]


@pytest.mark.parametrize("ids", CASES)
def test_all_ints_is_the_exact_type_loop(ids):
    assert all_ints(ids) is all(type(t) is int for t in ids)


@pytest.mark.parametrize("ids", [c for c in CASES if c and all(type(t) is int for t in c)])
def test_min_max_is_min_and_max(ids):
    assert min_max(ids) == (min(ids), max(ids))


def test_as_uint32_only_for_ids_in_range():
    assert as_uint32([0, 2**32 - 1]).tolist() == [0, 2**32 - 1]
    assert as_uint32([-1]) is None and as_uint32([2**32]) is None


def test_msgspec_bodies_equal_json_ones_and_encode_back_the_same():
    raw = b'{"prompt": [1, 2, 3], "t": 0.1, "s": "caf\\u00e9", "x": {"a": [null, true, -0.0, 1e-300]}, "a": 1, "a": 2}'
    body = load_json_object(raw)
    assert body == json.loads(raw)
    assert json.loads(encode_body(body)) == body


@pytest.mark.parametrize("number", [b"1e400", b"-1e400", b"1.8e308"])
def test_numbers_past_a_float_are_400_naming_the_body(number):
    with pytest.raises(BadRequest) as err:
        load_json_object(b'{"prompt": [1], "temperature": ' + number + b"}")
    assert err.value.param == "body" and "past a float's range" in err.value.message
