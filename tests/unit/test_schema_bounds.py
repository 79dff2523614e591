"""The regex that bounds logit_bias keys by the vocabulary in the published schema."""

from __future__ import annotations

import re

import pytest

from infer.server.app import uint_at_most_regex


@pytest.mark.parametrize("n", [0, 1, 9, 10, 99, 100, 101, 1023, 32000, 151935])
def test_matches_exactly_zero_to_n(n):
    pattern = re.compile(uint_at_most_regex(n))
    assert [i for i in range(2 * n + 20) if pattern.match(str(i))] == list(range(n + 1))
    for bad in ("", "-1", "01", "1.0", " 1", f"{n}0"):
        assert not pattern.match(bad), bad
