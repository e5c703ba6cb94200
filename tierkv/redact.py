"""Secrets out of everything tierkv prints, logs or exports.

Primitives: `is_secret_key`, `redact_url`, `redact_text`, `redact_value`, `redact_tree`.

    redis://user:S3cret@host:6379/0  ->  redis://user:***@host:6379/0
    {"tiers": [{"url": ..., "secret": "abc"}]}  ->  {"tiers": [{"url": <redacted>, "secret": "***"}]}

A config field is a secret when its name contains password, passwd, secret or credential, or
its last '_'-separated part is token, key, auth or apikey (`api_key`, `control_token` are;
`sink_tokens`, `sparse_token_budget`, `namespace` are not). URLs anywhere in a text have the password of their
userinfo replaced; query parameters named like secrets and `Bearer <credential>` too.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

MASK = "***"
_SECRET_WORDS = ("password", "passwd", "secret", "credential")  # anywhere in the name
_SECRET_PARTS = ("token", "key", "auth", "apikey")  # the last part of the name
_WHERE_PARTS = ("file", "path", "dir")  # secret_file names where the secret is, not the secret
_FLAG_PARTS = ("create", "is", "has", "use")  # create_secret_file is a switch
# a URL in free text: scheme:// and everything up to the next whitespace (its userinfo up to the last '@')
_URL_TOKEN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*")
_PLAIN_USER = re.compile(r"[^\s/@:?#]*")
_BEARER = re.compile(r"(?P<head>\bBearer\s+)\S{8,}")  # an Authorization header's credential, e.g. in a repr
_QUERY_SECRET = re.compile(r"(?P<head>[?&][^=&\s]*(?:password|passwd|secret|token|credential)[^=&\s]*=)(?P<secret>[^&\s#]*)",
                           re.IGNORECASE)


def is_secret_key(name: object) -> bool:
    """Whether a config field (or mapping key) of this name holds a secret."""
    if not isinstance(name, str):
        return False
    parts = re.split(r"[^a-z0-9]+", name.lower())
    if parts[-1] in _WHERE_PARTS or parts[0] in _FLAG_PARTS:  # where a secret is, or a switch about one
        return False
    return any(word in name.lower() for word in _SECRET_WORDS) or parts[-1] in _SECRET_PARTS


def redact_url(url: str) -> str:
    """`url`, taken whole (whitespace and all), with its userinfo's password (and secret-named query values)
    replaced by ***; a userinfo that is not plain `user:password` (an '@', '/' or whitespace in it) is
    masked whole, up to the last '@'."""
    if not isinstance(url, str):
        return url
    return _QUERY_SECRET.sub(lambda m: f"{m['head']}{MASK}", _mask_userinfo(url))


def redact_text(text: str) -> str:
    """`text` with every URL password, secret-named query value and bearer credential in it replaced by ***."""
    if not isinstance(text, str):
        return text
    text = _URL_TOKEN.sub(lambda m: _mask_userinfo(m[0]), text)
    text = _BEARER.sub(lambda m: f"{m['head']}{MASK}", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['head']}{MASK}", text)


def _mask_userinfo(url: str) -> str:
    """One URL with everything between '://' and its last '@' that may be a secret masked."""
    head, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    credentials, _, tail = rest.rpartition("@")
    user, colon, secret = credentials.partition(":")
    if not colon:  # a user name alone, or something that only looks like one
        return url if _PLAIN_USER.fullmatch(credentials) else f"{head}://{MASK}@{tail}"
    if not secret:
        return url
    if _PLAIN_USER.fullmatch(user) and not any(c in secret for c in "@/ \t\r\n"):
        return f"{head}://{user}:{MASK}@{tail}"
    return f"{head}://{MASK}@{tail}"


def redact_value(key: object, value: object) -> object:
    """What may be shown of `value` stored under config key `key` (a dotted path or a field name)."""
    last = key.rsplit(".", 1)[-1].split("[", 1)[0] if isinstance(key, str) else key
    if is_secret_key(last) and value is not None:
        return MASK
    if isinstance(value, str):
        return _redact_string(value)
    return redact_tree(value) if isinstance(value, (Mapping, list, tuple)) else value


def redact_tree(data: object, _depth: int = 0) -> object:
    """A copy of plain data (dicts, lists, strings) with secret-named entries and URL passwords masked."""
    if _depth > 64:
        return "..."
    if isinstance(data, Mapping):
        return {k: (MASK if is_secret_key(k) and v is not None else redact_tree(v, _depth + 1)) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_tree(v, _depth + 1) for v in data]
    if isinstance(data, str):
        return _redact_string(data)
    return data


def _redact_string(text: str) -> str:
    """A config string: a URL taken whole (`redact_url`), any other text word by word (`redact_text`)."""
    return redact_url(text) if _URL_TOKEN.match(text) else redact_text(text)
