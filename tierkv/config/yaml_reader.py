"""The config files' YAML reader: PyYAML's safe loader with YAML 1.2's numbers, refusing documents nested too
deep and keys given twice before building them.

Numbers are read as the TIERKV_* variables read them: decimal integers only (YAML 1.1 would read 0100 as
octal 64, 1:30 as 90 and 0x20 as hex; here 0100 is 100 and the others stay text, which a number field
refuses by name), and floats with or without a dot before the exponent (1e2 is 100.0; YAML 1.1 reads it as
text). Booleans stay YAML's: true, false, yes, no, on, off.

Primitives: `_yaml_load`, `dump_yaml`, `MAX_DEPTH`, and what it raises (`_TooDeep`, `_DuplicateKey`, `_YAML_ERRORS`).
"""
from __future__ import annotations

import math
import re

import yaml

_YAML_ERRORS = (yaml.YAMLError, ValueError, OverflowError, RecursionError, MemoryError)
_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where installed: linear in the text
MAX_DEPTH = 32  # nesting levels in a document; a config needs 4


_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_INT = re.compile(r"^[-+]?[0-9]+$")
_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_MAX_DIGITS = 400  # a longer integer stays text (refused by name) instead of a quadratic conversion


class _Loader(_BASE_LOADER):
    """The safe loader with YAML 1.2's core-schema numbers (decimal integers; floats as above)."""


class _Dumper(yaml.SafeDumper):
    """The safe dumper with the loader's numbers: it quotes a string the loader would read as a number (a hex
    token of digits and one 'e', '0100'), which YAML 1.1's rules leave bare."""


def _numbers_of_yaml_1_2() -> None:
    for cls in (_Loader, _Dumper):
        resolvers = {}
        for first, entries in cls.yaml_implicit_resolvers.items():
            kept = [(tag, regexp) for tag, regexp in entries if tag not in (_INT_TAG, _FLOAT_TAG)]
            if kept:
                resolvers[first] = kept
        cls.yaml_implicit_resolvers = resolvers
        cls.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
        cls.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+.0123456789"))
    _Loader.add_constructor(_INT_TAG, _construct_int)
    _Loader.add_constructor(_FLOAT_TAG, _construct_float)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> object:
    text = loader.construct_scalar(node)
    if not _INT.match(text):  # an explicit !!int tag on something else: YAML's own reading is not ours
        raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not a decimal integer", node.start_mark)
    return int(text, 10) if len(text) <= _MAX_DIGITS else text


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> object:
    text = loader.construct_scalar(node)
    lowered = text.lower()
    if lowered.lstrip("+-") == ".inf":
        return -math.inf if lowered.startswith("-") else math.inf
    if lowered == ".nan":
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not a number", node.start_mark) from None


_numbers_of_yaml_1_2()
_LOADER = _Loader


def dump_yaml(data: object, stream=None, **options):
    """yaml.safe_dump as this reader reads it back: every string stays a string."""
    return yaml.dump(data, stream, Dumper=_Dumper, **options)


class _TooDeep(Exception):
    pass


class _DuplicateKey(Exception):
    pass


def _yaml_load(text: str) -> object:
    """yaml.safe_load, refusing documents nested deeper than MAX_DEPTH before building them, and a key
    given twice in one mapping (YAML would keep the last silently)."""
    frames: list[list] = []  # per open collection: [is_mapping, keys seen, next scalar is a key]
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent, yaml.CollectionStartEvent)) and frames:
            frame = frames[-1]
            if frame[0]:
                if frame[2] and isinstance(event, yaml.ScalarEvent):
                    if event.value in frame[1]:
                        line = event.start_mark.line + 1 if event.start_mark is not None else "?"
                        raise _DuplicateKey(f"key {event.value!r} given twice in one mapping (line {line})")
                    frame[1].add(event.value)
                frame[2] = not frame[2]
        if isinstance(event, yaml.CollectionStartEvent):
            frames.append([isinstance(event, yaml.MappingStartEvent), set(), True])
            if len(frames) > MAX_DEPTH:
                raise _TooDeep(f"nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            frames.pop()
    return yaml.load(text, Loader=_LOADER)
