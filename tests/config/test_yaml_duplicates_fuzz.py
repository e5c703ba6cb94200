"""The config reader's duplicate-key check (`config.load._yaml_load`) against PyYAML itself: any document
without a repeated key in one mapping reads as PyYAML's safe loader with the reader's YAML 1.2 numbers
(`yaml_reader._LOADER`) reads it (block and flow styles, nested
mappings and lists, keys repeated across mappings); the same document with one key repeated in one
mapping is refused."""
from __future__ import annotations

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tierkv.config.load import _DuplicateKey, _yaml_load  # noqa: E402
from tierkv.config.yaml_reader import _LOADER  # noqa: E402

KEYS = st.sampled_from(["cache", "tiers", "kind", "path", "a", "b", "block_tokens", "x y", "1", "true"])
SCALARS = st.one_of(st.integers(-5, 10**6), st.booleans(), st.none(), st.text(max_size=8),
                    st.floats(allow_nan=False, allow_infinity=False))
DOCS = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(KEYS, inner, max_size=4)), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(doc=st.dictionaries(KEYS, DOCS, min_size=1, max_size=5), flow=st.booleans())
def test_documents_without_repeats_read_as_pyyaml_reads_them(doc, flow):
    text = yaml.safe_dump(doc, default_flow_style=flow)
    assert _yaml_load(text) == yaml.load(text, Loader=_LOADER)


@settings(max_examples=200, deadline=None)
@given(doc=st.dictionaries(KEYS, DOCS, min_size=1, max_size=5), flow=st.booleans(), data=st.data())
def test_a_key_repeated_in_one_mapping_is_refused(doc, flow, data):
    text = yaml.safe_dump(doc, default_flow_style=flow)
    # repeat the first top-level key at the end of the top mapping (block style: a new line; flow: inside braces)
    key = next(iter(doc))
    extra = yaml.safe_dump({key: data.draw(SCALARS)}, default_flow_style=flow).strip()
    if flow:
        repeated = text.strip()[:-1] + ", " + extra[1:-1] + "}\n"
    else:
        repeated = text + extra + "\n"
    with pytest.raises(_DuplicateKey, match="given twice"):
        _yaml_load(repeated)
