"""tierkv.longdoc: planted facts land once, near their depth, in a document of the asked length."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tierkv.longdoc import haystack_text, multikey_case, plant


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tierkv.model_loading import shortcut_source

    source = shortcut_source("smollm2-135m")
    return AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)


@settings(max_examples=15, deadline=None)
@given(num_tokens=st.integers(64, 9000), depth=st.floats(0.0, 1.0))
def test_planted_sentence_appears_once_near_its_depth(tokenizer, num_tokens, depth):
    text, _ = haystack_text()
    sentence = "The secret pass key is 31415. Remember it."
    document = plant(tokenizer, text, num_tokens, [(depth, sentence)])
    assert document.count(sentence) == 1
    rest = document.replace(f"\n{sentence}\n", "", 1)
    assert abs(len(tokenizer(rest, add_special_tokens=False)["input_ids"]) - num_tokens) <= 0.02 * num_tokens + 4
    at = document.index(sentence) / max(1, len(rest))
    assert abs(at - depth) <= 0.1 + 200 / len(rest)  # the nearest line break; lines are short in the text


@pytest.mark.parametrize("depth", [-0.1, 1.5])
def test_depth_outside_zero_to_one_is_refused(tokenizer, depth):
    with pytest.raises(ValueError, match=f"depth {depth} is not in"):
        plant(tokenizer, "some text\nmore", 64, [(depth, "fact")])


def test_multikey_asks_for_the_key_at_its_depth_among_others(tokenizer):
    case = multikey_case(tokenizer, 1500, 0.5, seed=2)
    text = tokenizer.decode(case.prompt_ids)
    assert text.count("The pass key for ") == 4 and f"is {case.answer}." in text
    name = case.question.split("pass key for ")[1].split(" ")[0]
    assert f"The pass key for {name} is {case.answer}." in text
