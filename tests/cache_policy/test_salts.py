"""Cache salts by weight version under the four weight-update policies (seed 003)."""

from __future__ import annotations

import pytest

from cache_policy.salts import cache_salt_for_version, choose_salt


def test_salt_for_version() -> None:
    assert cache_salt_for_version(None) is None
    assert cache_salt_for_version(3) == "rr:v3"
    assert cache_salt_for_version(0, "teacher") == "teacher:v0"
    with pytest.raises(ValueError, match="version"):
        cache_salt_for_version(-1)
    with pytest.raises(ValueError, match="namespace"):
        cache_salt_for_version(1, "")


@pytest.mark.parametrize("policy", ["flush", "keep"])
def test_flush_and_keep_use_no_salt(policy) -> None:
    assert choose_salt(policy, 5, 3, 5) is None


def test_salt_uses_the_loaded_version() -> None:
    assert choose_salt("salt", 4, 3, 5) == "rr:v5"
    assert choose_salt("salt", 4, None, None) == "rr:v4"  # loaded unknown: request's own
    assert choose_salt("salt", None, None, None) is None


def test_keep_plus_salt() -> None:
    assert choose_salt("keep+salt", 5, 3, 5) == "rr:v3"  # in-flight session keeps its salt
    assert choose_salt("keep+salt", 5, None, 5) == "rr:v5"  # new session: loaded version
    assert choose_salt("keep+salt", 5, 5, 5) == "rr:v5"
    assert choose_salt("keep+salt", 6, 7, 6) == "rr:v6"  # started "later": loaded version


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="weight_update_policy"):
        choose_salt("salted", 1, 1, 1)  # type: ignore[arg-type]
