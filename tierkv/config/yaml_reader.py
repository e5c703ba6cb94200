"""The config files' YAML reader: PyYAML's safe loader, refusing documents nested too deep and keys given
twice before building them.

Primitives: `_yaml_load`, `MAX_DEPTH`, and what it raises (`_TooDeep`, `_DuplicateKey`, `_YAML_ERRORS`).
"""
from __future__ import annotations

import yaml

_YAML_ERRORS = (yaml.YAMLError, ValueError, OverflowError, RecursionError, MemoryError)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where installed: linear in the text
MAX_DEPTH = 32  # nesting levels in a document; a config needs 4


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
