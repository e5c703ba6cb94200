"""Config fuzzing: any document, file or TIERKV_* environment either loads into a config whose
tiers can be built and used, or raises ConfigError; never another exception.

Three properties, over (1) YAML documents (and the same data passed as a dict) drawn from the
real config's key tree with values mutated to wrong types, nesting, NaN/inf, huge ints,
strings with NUL and unicode, (2) arbitrary bytes files, (3) TIERKV_* overrides along the real
tree and random paths. Tiers are built on the CPU in a tmp dir (cwd and HOME point there);
Redis tiers point at a loopback port nothing listens on, so they start unhealthy and degrade.
Paths the fuzzer writes are relative names without '/', '.' or '~' (or ones named here), so
nothing outside the tmp dir is touched.
"""
from __future__ import annotations

import dataclasses
import socket
import typing

import pytest
import torch
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tierkv.blocks import BlockLayout  # noqa: E402
from tierkv.config import TIER_CONFIG_KINDS, ConfigError, TierKVConfig, load_config  # noqa: E402
from tierkv.storage import build_tiers  # noqa: E402

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])
LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=16, head_dim=64, dtype=torch.bfloat16)  # 8 KiB blocks
SAFE_CHARS = st.characters(blacklist_characters="/.~\\", blacklist_categories=("Cs",))


def dead_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: nothing listens there


DEAD_PORT = dead_port()

# -- values -----------------------------------------------------------------------------------
huge_ints = st.sampled_from([2**31, 2**50 + 1, 2**63, 2**64 + 1, 10**30, -(2**63)])
floats = st.floats(allow_nan=True, allow_infinity=True)
texts = st.text(SAFE_CHARS, max_size=12) | st.sampled_from(["a\x00b", "\x00", "é☃𝄞", " ", "yes", "1e400"])
scalars = st.none() | st.booleans() | st.integers() | huge_ints | floats | texts
wild = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                    max_leaves=6)
sizes = st.sampled_from(["64KiB", "1 MiB", 65536, "8KiB", "1.5B", "2 parsecs", "99999999999999999999999 TiB",
                         "0", 0, -1, 4096.0, 4096.5, float("inf"), float("nan"), 2**50, 2**50 + 1, 10**40])
paths = st.one_of(
    st.sampled_from(["blocks", "~/blocks", "~nosuchuser/blocks", "a\x00b", "x" * 300, "/".join(["y" * 200] * 30),
                     "", "blocks/../blocks", 7, None, ["blocks"]]),
    st.lists(st.text(SAFE_CHARS, min_size=1, max_size=8), min_size=1, max_size=3).map("/".join),
)
url_user = st.sampled_from(["", ":S3cret-pw@", "user:S3cret-pw@", "user@", ":p%00w@", ":@"])
url_query = st.sampled_from(["", "?db=1", "?foo=bar", "?socket_timeout=inf", "?ssl_cert_reqs=none",
                             "?client_name=a b", "?db=x", "?health_check_interval=nan", "?db="])
url_tail = st.sampled_from(["/0", "", "/", "/zero", "/99999999999999999999", ":99999/0", ":0/0", ":x/0"])
urls = st.one_of(
    st.builds(lambda scheme, user, tail, query: f"{scheme}://{user}127.0.0.1:{DEAD_PORT}{tail}{query}",
              st.sampled_from(["redis", "rediss", "REDIS", "http"]), url_user, url_tail, url_query),
    st.builds(lambda user, tail, query: f"redis://{user}localhost{tail}{query}", url_user, url_tail, url_query),
    st.builds(lambda name, query: f"unix://./{name}.sock{query}", st.text(SAFE_CHARS, min_size=1, max_size=6),
              st.sampled_from(["", "?db=2", "?ssl_cert_reqs=none", "?x=1"])),
    st.sampled_from(["redis://%00/0", "redis://" + "a" * 70 + "/0", "redis://a..b/0", "redis://[::1/0", "unix://",
                     "redis://h\u2603/0", "redis:///0"]),
    texts, st.integers(),
)


good_paths = st.lists(st.text(SAFE_CHARS, min_size=1, max_size=8), min_size=1, max_size=3).map("/".join)
good_urls = st.builds(lambda scheme, user, db, query: f"{scheme}://{user}127.0.0.1:{DEAD_PORT}/{db}{query}",
                      st.sampled_from(["redis", "rediss"]), url_user, st.integers(0, 15),
                      st.sampled_from(["", "?client_name=tierkv"]))
good_sizes = st.sampled_from(["64KiB", "1 MiB", 65536, 2**20, "8KiB", "2MiB"])


def field_values(name: str, tp: object, meta: dict, *, bad: bool) -> st.SearchStrategy:
    """Values of one field: plausible ones, or (bad=True) wrong and hostile ones."""
    if name == "path" or name.endswith("_path"):
        return paths if bad else good_paths  # never arbitrary text: a fuzzed path stays inside the tmp dir
    if name == "url":
        return urls if bad else good_urls
    if name.endswith("_bytes"):
        return (sizes | wild) if bad else good_sizes
    if meta.get("choices"):
        return wild if bad else st.sampled_from(meta["choices"])
    if bad:
        return wild
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return {bool: st.booleans(), int: st.integers(1, 64), float: st.floats(0.01, 10)}.get(args[0], texts)


def section(cls: type, *, bad: bool = False) -> st.SearchStrategy:
    """A mapping of some of `cls`'s fields (bad: and an unknown key now and then); a path is always
    given, and a Redis URL: no default path outside the tmp dir is written, no default port dialled."""
    hints = typing.get_type_hints(cls)
    known = {f.name: field_values(f.name, hints[f.name], dict(f.metadata), bad=bad) for f in dataclasses.fields(cls)
             if not dataclasses.is_dataclass(hints[f.name]) and f.name != "tiers"}
    required = {name: known.pop(name) for name in list(known) if name in ("path", "url")}
    extra = {"bogus_key": wild} if bad else {}
    return st.fixed_dictionaries(required, optional={**known, **extra})


def tier(kind: str, *, bad: bool = False) -> st.SearchStrategy:
    return section(TIER_CONFIG_KINDS[kind], bad=bad).map(lambda d: {**d, "kind": kind})


SECTIONS = {name: f.default_factory for name, f in TierKVConfig.__dataclass_fields__.items() if name != "tiers"}
good_documents = st.fixed_dictionaries({}, optional={
    **{name: section(cls) for name, cls in SECTIONS.items()},
    "tiers": st.builds(lambda cpu, rest: [cpu] + rest, tier("cpu"),
                       st.lists(st.sampled_from(["disk", "redis"]).flatmap(tier), max_size=2)),
})


def hostile(name: str, tp: object) -> st.SearchStrategy:
    """Wrong values aimed at one field's type: inf/nan/huge for numbers, NUL and surrogates for text."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if name == "path" or name.endswith("_path") or name == "url" or name.endswith("_bytes"):
        return field_values(name, tp, {}, bad=True)
    if args[0] is float:
        return st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e300, 10**400, -1.0]) | wild
    if args[0] is int:
        return huge_ints | wild
    if args[0] is str:
        return st.sampled_from(["a\x00b", "\ud800", "", "é☃𝄞"]) | wild
    return wild


def _mutable() -> list[tuple[str, str]]:
    """(section or tier kind, field) pairs; paths, URLs, floats and strings, where raw failures hid, 4 times."""
    pairs = []
    for target, cls in [*SECTIONS.items(), *TIER_CONFIG_KINDS.items()]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "kind" or dataclasses.is_dataclass(hints[f.name]):
                continue
            args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
            risky = f.name in ("path", "url") or f.name.endswith("_path") or args[0] in (float, str)
            pairs += [(target, f.name)] * (4 if risky else 1)
    return pairs


MUTABLE = _mutable()


@st.composite
def mutated_documents(draw) -> dict:
    """A plausible document with one value, section or the tier list replaced by a hostile one."""
    doc = draw(good_documents)
    how = draw(st.sampled_from(["value", "value", "value", "section", "tiers"]))
    if how == "section":
        name = draw(st.sampled_from(list(SECTIONS)))
        doc[name] = draw(section(SECTIONS[name], bad=True) | wild)
    elif how == "tiers":
        doc["tiers"] = draw(wild | st.lists(st.sampled_from(list(TIER_CONFIG_KINDS)).flatmap(tier), max_size=2)
                            | st.lists(st.sampled_from(list(TIER_CONFIG_KINDS)).flatmap(lambda k: tier(k, bad=True)),
                                       min_size=1, max_size=2))
    else:
        target, name = draw(st.sampled_from(MUTABLE))
        if target in SECTIONS:
            cls, holder = SECTIONS[target], doc.setdefault(target, {})
        else:
            cls, holder = TIER_CONFIG_KINDS[target], draw(tier(target))
            tiers = doc.setdefault("tiers", [{"kind": "cpu"}])
            tiers[:1 if target == "cpu" else len(tiers)] = [holder] if target == "cpu" else tiers + [holder]
        hints = typing.get_type_hints(cls)
        holder[name] = draw(hostile(name, hints[name]))
    return doc


documents = st.one_of(good_documents, mutated_documents(), mutated_documents(), mutated_documents())


# -- the property ---------------------------------------------------------------------------------
@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def loads_and_works_or_config_error(source, sandbox, env=None) -> None:
    """The property: ConfigError, or a config whose tiers build and store a block."""
    try:
        config = load_config(source, env=env or {})
    except ConfigError as err:
        assert err.key and err.allowed
        return
    for tier_config in config.tiers:
        if tier_config.kind == "disk":
            from pathlib import Path

            resolved = Path(tier_config.path).expanduser().resolve()
            assert resolved.is_relative_to(sandbox), f"fuzzer escaped its sandbox: {resolved}"
    small = [dataclasses.replace(t, capacity_bytes=min(t.capacity_bytes, 1 << 20)) if t.kind == "cpu" else t
             for t in config.tiers]  # the slab of the one cpu tier: this test allocates, not measures
    try:
        chain = build_tiers(small, LAYOUT, pin_memory=False)
    except ConfigError:
        return
    try:
        block = torch.ones(LAYOUT.shape, dtype=LAYOUT.dtype)
        assert chain.put_many(["k"], [block])[0].ok
        assert torch.equal(chain.get_many(["k"])[0], block)
    finally:
        chain.close()


@FUZZ
@given(doc=documents)
def test_any_document_loads_and_builds_or_raises_config_error(doc, sandbox):
    loads_and_works_or_config_error(doc, sandbox)
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return  # a value YAML cannot write (the dict form above covered it)
    path = sandbox / "fuzzed.yaml"
    path.write_text(text, encoding="utf-8")
    loads_and_works_or_config_error(path, sandbox)


byte_files = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda depth, head: (head + "[" * depth).encode(), st.integers(1, 20000), st.sampled_from(["", "a: "])),
    st.builds(lambda t: t.encode("utf-16"), st.text(max_size=40)),
    st.builds(lambda t, tail: t.encode() + tail, st.sampled_from(["cache:\n  block_tokens: ", "tiers:\n- kind: "]),
              st.binary(max_size=8)),
    st.just(b"a: &a [*a, *a]\nb: &b [*a, *a, *a]\nmodel: &c [*b, *b, *b, *b]\ncache: [*c, *c, *c]\n"),
    st.just(b"cache: {block_tokens: " + b"9" * 5000 + b"}\n"),
    st.just(b"? [a, b]\n: 1\n"),
)


@FUZZ
@given(data=byte_files)
def test_any_bytes_file_loads_or_raises_config_error(data, sandbox):
    path = sandbox / "fuzzed.yaml"
    path.write_bytes(data)
    loads_and_works_or_config_error(path, sandbox)


def _env_keys() -> st.SearchStrategy:
    real = []
    for name, value in yaml.safe_load(yaml.safe_dump(dataclasses.asdict(TierKVConfig()))).items():
        real += [[name, k] for k in value] if isinstance(value, dict) else [[name]]
    real += [["tiers", "0", k] for k in ("kind", "capacity_bytes", "storage_dtype")] + [["tiers"], ["tiers", "1"]]
    segment = st.text("abcdefghijklmnopqrstuvwxyz_0123456789", max_size=6).filter(lambda s: s != "path")
    paths_ = st.sampled_from(real) | st.lists(segment, min_size=0, max_size=4)
    deeper = st.builds(lambda p, extra: p + extra, paths_, st.lists(segment, max_size=2))
    return deeper.map(lambda parts: "TIERKV_" + "__".join(parts).upper())


env_values = st.one_of(
    st.text(SAFE_CHARS, max_size=16),
    st.sampled_from([".inf", ".nan", "-.inf", "1e400", "[1, 2]", "{a: 1}", "[" * 3000, "~nosuchuser", "a\x00b",
                     "2GiB", "0", "-1", "true", "yes", "null", "[{kind: cpu}]", "2001-02-30", "9" * 5000, "\ud800",
                     f"redis://:S3cret@127.0.0.1:{DEAD_PORT}/0?foo=1", "{kind: disk, path: blocks}"]),
)


@FUZZ
@given(env=st.dictionaries(_env_keys(), env_values, max_size=4),
       with_disk=st.booleans())
def test_any_environment_loads_and_builds_or_raises_config_error(env, with_disk, sandbox):
    base = {"tiers": [{"kind": "cpu", "capacity_bytes": "1MiB"}]}
    if with_disk:
        base["tiers"].append({"kind": "disk", "path": "blocks", "capacity_bytes": "1MiB"})
    loads_and_works_or_config_error(base, sandbox, env=env)
