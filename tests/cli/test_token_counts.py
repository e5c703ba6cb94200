"""Token counts on the command line: binary k/M suffixes (128k = 131072, 1M = 1048576), whole
counts of at least 1, and a ValueError naming the value for anything else."""
from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tierkv.units import MAX_TOKENS, SHOWN_CHARS, parse_tokens

SUFFIXES = {"": 1, "k": 1024, "K": 1024, "Ki": 1024, "ki": 1024, "M": 1024**2, "m": 1024**2, "Mi": 1024**2}


@given(st.integers(1, 10**7), st.sampled_from(sorted(SUFFIXES)), st.sampled_from(["", " "]))
def test_whole_counts_with_any_suffix(number, suffix, space):
    tokens = number * SUFFIXES[suffix]
    if tokens > MAX_TOKENS:  # a typo, not a request: refused naming the bound
        with pytest.raises(ValueError, match=f"at most {MAX_TOKENS}"):
            parse_tokens(f"{number}{space}{suffix}")
        return
    assert parse_tokens(f"{number}{space}{suffix}") == tokens


@given(st.integers(1, 10**9))
def test_plain_ints_and_their_text(number):
    assert parse_tokens(number) == parse_tokens(str(number)) == number


@given(st.text(max_size=12))
@example("0\x1f\x1f" + "\U00018d09" * 9)  # a repr of 81 characters: cut in the message
def test_any_text_is_a_positive_count_or_a_value_error_naming_it(text):
    try:
        value = parse_tokens(text)
    except ValueError as exc:  # a repr past SHOWN_CHARS (a few astral characters) is cut, with its length
        shown = repr(text) if len(repr(text)) <= SHOWN_CHARS else f"{repr(text)[:SHOWN_CHARS - 5]}..."
        assert shown in str(exc)
    else:
        assert isinstance(value, int) and value >= 1


@pytest.mark.parametrize("bad", ["0", "0k", "1.3k", "0.1", "-1", "1e5", "k", "", "12x", "1G", "1.5", "2MiB"])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match="tokens"):
        parse_tokens(bad)


@pytest.mark.parametrize("bad", [True, 1.5, None, [1]])
def test_non_text_values_are_refused(bad):
    with pytest.raises(ValueError, match="number of tokens"):
        parse_tokens(bad)
