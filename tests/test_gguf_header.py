"""A GGUF file's shape is read from its header before the weights load: the same shape transformers' own GGUF config
gives, every header value as the gguf package reads it, a damaged header refused naming the file (never another
exception, never a long read), and a config that pins another shape refused before the load."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")  # the real-model extra: .ci/run installs it

from tierkv.gguf_header import ARRAY, CHECKED_ARCHITECTURES, gguf_kv_shape, read_gguf_metadata  # noqa: E402
from tierkv.model_shape import model_shape  # noqa: E402


def _write(path, architecture: str, items: list[tuple[str, str, object]], tensor: bool = True) -> str:
    """A GGUF file of `architecture` with `items` (key, gguf writer method, value) in that order and one small
    tensor; returns its path."""
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, method, value in items:
        getattr(writer, method)(key, value)
    if tensor:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@st.composite
def shapes(draw):
    architecture = draw(st.sampled_from(CHECKED_ARCHITECTURES))
    kv_heads = draw(st.integers(1, 8))
    heads = kv_heads * draw(st.integers(1, 6))
    head_dim = draw(st.sampled_from([16, 32, 48, 64, 80, 96, 128, 256]))
    hidden = heads * head_dim * draw(st.sampled_from([1, 1, 2]))  # a head_dim that is not hidden / heads too
    a = architecture
    items = [(f"{a}.block_count", "add_uint32", draw(st.integers(1, 80))),
             (f"{a}.attention.head_count", "add_uint32", heads),
             (f"{a}.embedding_length", "add_uint32", hidden),
             (f"{a}.context_length", "add_uint32", draw(st.sampled_from([2048, 8192, 131072]))),
             ("tokenizer.ggml.tokens", "add_array", [f"t{i}" for i in range(draw(st.integers(0, 300)))]),
             ("tokenizer.ggml.token_type", "add_array", list(range(draw(st.integers(0, 50))))),
             ("general.name", "add_string", draw(st.text(max_size=20)))]
    if draw(st.booleans()):
        items.append((f"{a}.attention.head_count_kv", "add_uint32", kv_heads))
    if draw(st.booleans()):
        items.append((f"{a}.rope.dimension_count", "add_uint32", head_dim))
    if draw(st.booleans()):
        items.append((f"{a}.attention.key_length", "add_uint32", head_dim))
    return architecture, draw(st.permutations(items))


@settings(max_examples=40)
@given(shapes())
def test_the_header_gives_the_shape_transformers_gives(tmp_path_factory, drawn):
    from transformers import AutoConfig

    architecture, items = drawn
    directory = tmp_path_factory.mktemp("gguf")
    path = _write(directory / "m.gguf", architecture, items)
    try:
        expected = model_shape(AutoConfig.from_pretrained(str(directory), gguf_file="m.gguf")).kv_shape()
    except ValueError:
        expected = None  # no shape to read before the load: the load's own check decides
    assert gguf_kv_shape(path) == expected


def _ints(method: str, bits: int, signed: bool):
    low, high = (-2**(bits - 1), 2**(bits - 1) - 1) if signed else (0, 2**bits - 1)
    return st.tuples(st.just(method), st.integers(low, high))


VALUES = st.one_of(
    *(_ints(f"add_{'' if signed else 'u'}int{bits}", bits, signed) for bits in (8, 16, 32, 64) for signed in (0, 1)),
    st.tuples(st.just("add_float32"), st.floats(width=32, allow_nan=False)),
    st.tuples(st.just("add_float64"), st.floats(allow_nan=False)), st.tuples(st.just("add_bool"), st.booleans()),
    st.tuples(st.just("add_string"), st.text(max_size=40)),
    st.tuples(st.just("add_array"), st.lists(st.integers(0, 1000), max_size=20)),
    st.tuples(st.just("add_array"), st.lists(st.text(max_size=8), max_size=20)),
)


@settings(max_examples=60)
@given(st.dictionaries(st.from_regex(r"[a-z]{1,8}(\.[a-z_]{1,8}){0,3}", fullmatch=True), VALUES, max_size=12))
def test_every_value_reads_as_the_gguf_package_reads_it(tmp_path_factory, values):
    values.pop("general.architecture", None)
    path = _write(tmp_path_factory.mktemp("gguf") / "m.gguf", "llama",
                  [(key, method, value) for key, (method, value) in values.items()])
    ours = read_gguf_metadata(path)
    theirs = {key: field for key, field in gguf.GGUFReader(path).fields.items() if not key.startswith("GGUF.")}
    assert set(ours) == set(theirs)
    for key, field in theirs.items():
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert ours[key] is ARRAY, key
        else:
            assert ours[key] == field.contents(), key


def _small_header(tmp_path) -> tuple[str, int]:
    """A valid file and the length of its header's key-value part, as the gguf package reads it (the padding to
    the data's alignment follows it)."""
    items = [("llama.block_count", "add_uint32", 2), ("llama.attention.head_count", "add_uint32", 4),
             ("llama.embedding_length", "add_uint32", 64), ("tokenizer.ggml.tokens", "add_array", ["a", "bc", "def"]),
             ("general.name", "add_string", "tiny")]
    path = _write(tmp_path / "m.gguf", "llama", items, tensor=False)
    last = list(gguf.GGUFReader(path).fields.values())[-1]
    end = last.offset + sum(part.nbytes for part in last.parts)
    assert end <= os.path.getsize(path)
    return path, end


def test_every_truncation_of_a_header_is_refused_naming_the_file(tmp_path):
    path, size = _small_header(tmp_path)
    data = open(path, "rb").read()
    assert read_gguf_metadata(path)["llama.block_count"] == 2
    for cut in range(size):
        cut_path = tmp_path / f"cut{cut}.gguf"
        cut_path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"cut{cut}.gguf"):
            read_gguf_metadata(cut_path)
        assert gguf_kv_shape(cut_path) is None


@settings(max_examples=200)
@given(st.data())
def test_a_damaged_header_reads_or_is_refused_with_a_value_error(tmp_path_factory, data):
    path, size = _small_header(tmp_path_factory.mktemp("gguf"))
    raw = bytearray(open(path, "rb").read())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(4, size - 1))] = data.draw(st.integers(0, 255))
    with open(path, "wb") as f:
        f.write(raw)
    try:
        metadata = read_gguf_metadata(path)
    except ValueError as exc:
        assert path in str(exc)
    else:
        assert isinstance(metadata, dict)
    gguf_kv_shape(path)  # a dict or None, never an exception


ONE_KEY = struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 3) + b"key"  # version 3, no tensors, one pair: "key"


@pytest.mark.parametrize("tail, words", [
    (ONE_KEY + struct.pack("<IIQ", 9, 0, 2**62), "past the file"),  # 2**62 uint8 elements
    (ONE_KEY + struct.pack("<IIQ", 9, 8, 2**40), "past the file"),  # 2**40 strings
    (ONE_KEY + struct.pack("<I", 13), "unknown type 13"),
    (struct.pack("<IQQ", 3, 0, 2**63), "past the file"),  # 2**63 pairs
    (struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**20) + b"k", "a GGUF key of 1048576 bytes"),
    (ONE_KEY + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 2000, "nested over 8 deep"),
    (struct.pack("<I", 1), "GGUF version 1"),
], ids=["bytes", "strings", "type", "pairs", "key", "nested", "version"])
def test_a_hostile_header_is_refused_at_once(tmp_path, tail, words):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + tail + b"\0" * 64)
    with pytest.raises(ValueError, match=words):
        read_gguf_metadata(path)


def test_an_architecture_outside_the_checked_ones_is_left_to_the_load(tmp_path):
    items = [("gemma2.block_count", "add_uint32", 2), ("gemma2.attention.head_count", "add_uint32", 4),
             ("gemma2.embedding_length", "add_uint32", 64)]
    assert gguf_kv_shape(_write(tmp_path / "m.gguf", "gemma2", items)) is None


@pytest.mark.real_model
@pytest.mark.parametrize("key, value, actual", [("num_layers", 31, 30), ("num_kv_heads", 9, 3), ("head_dim", 128, 64)])
def test_the_shortcuts_gguf_refuses_another_shape_before_its_weights_load(monkeypatch, key, value, actual):
    import transformers

    from tierkv import TieredLLM
    from tierkv.config import ConfigError

    loads = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    words = rf"model\.{key}'?: got {value}; the model has {actual} \(.*SmolLM2.*\.gguf\)"  # the file is named
    with pytest.raises(ConfigError, match=words):
        TieredLLM("smollm2-135m", {"model": {key: value}}, device="cpu", show_progress=False)
    assert loads == []


@pytest.mark.parametrize("model, reads", [({}, 0), ({"head_dim": 16}, 1)])
def test_the_header_is_read_for_the_check_only_when_the_config_pins_a_shape(tmp_path, monkeypatch, model, reads):
    import transformers

    import tierkv.model_loading as model_loading
    from tierkv import TieredLLM

    items = [("llama.block_count", "add_uint32", 2), ("llama.attention.head_count", "add_uint32", 4),
             ("llama.embedding_length", "add_uint32", 64)]
    path = _write(tmp_path / "m.gguf", "llama", items)
    calls = []
    monkeypatch.setattr(model_loading, "gguf_kv_shape", lambda p: calls.append(p) or gguf_kv_shape(p))

    def loaded(*args, **kwargs):
        raise RuntimeError("the weights would load here")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    with pytest.raises(RuntimeError, match="the weights would load here"):  # a matching or unpinned shape goes on
        TieredLLM(path, {"model": model}, device="cpu", show_progress=False)
    assert len(calls) == reads
