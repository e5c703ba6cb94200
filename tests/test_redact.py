"""Secrets never printed: URL passwords and secret-named fields in logs, errors, dumps and stats."""
from __future__ import annotations

import logging
import socket

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from tierkv.blocks import BlockLayout
from tierkv.cli import main
from tierkv.config import ConfigError, load_config
from tierkv.config.load import shown_dict, to_dict
from tierkv.redact import is_secret_key, redact_text, redact_tree, redact_url, redact_value

SECRET = "S3cret-pa55"
LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=16, head_dim=64, dtype=torch.bfloat16)


def dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("text", [
    f"redis://:{SECRET}@h:6379/0", f"rediss://user:{SECRET}@h/1", f"unix://:{SECRET}@/tmp/r.sock",
    f"error at redis://u:{SECRET}@10.0.0.1:1/0 and redis://:{SECRET}@b", f"redis://h/0?password={SECRET}&db=1",
    f"redis://:{SECRET}@h/0?client_token={SECRET}", f"redis://:p@{SECRET}@h/0",
])
def test_urls_lose_their_passwords_and_keep_the_rest(text):
    shown = redact_text(text)
    assert SECRET not in shown and "***" in shown
    assert shown.split("://")[0] == text.split("://")[0]


@pytest.mark.parametrize("name,secret", [
    ("password", True), ("secret", True), ("token", True), ("control_token", True), ("api_key", True),
    ("redis_password", True), ("auth_secret", True), ("secret_file", False), ("create_secret_file", False), ("sink_tokens", False), ("sparse_token_budget", False),
    ("namespace", False), ("kind", False), ("capacity_bytes", False), ("url", False),
])
def test_secret_field_names(name, secret):
    assert is_secret_key(name) is secret


def test_redact_tree_masks_nested_secrets_and_leaves_the_input_alone():
    data = {"tiers": [{"kind": "redis", "url": f"redis://:{SECRET}@h/0", "secret": SECRET}], "token": SECRET,
            "sink_tokens": 64}
    shown = redact_tree(data)
    assert SECRET not in repr(shown)
    assert shown["sink_tokens"] == 64 and shown["tiers"][0]["kind"] == "redis"
    assert data["tiers"][0]["secret"] == SECRET  # a copy


def redis_config(url: str) -> dict:
    return {"tiers": [{"kind": "cpu", "capacity_bytes": "1MiB"}, {"kind": "redis", "url": url}],
            "storage": {"secret": "redaction-test-deployment-secret"}}


def test_the_unreachable_redis_warning_hides_the_password(caplog):
    from tierkv.storage import build_tiers

    config = load_config(redis_config(f"redis://:{SECRET}@127.0.0.1:{dead_port()}/0"), env={})
    with caplog.at_level(logging.DEBUG):
        chain = build_tiers(config.tiers, LAYOUT, pin_memory=False, storage=config.storage)
        try:
            block = torch.zeros(LAYOUT.shape, dtype=LAYOUT.dtype)
            chain.put_many(["k"], [block], start=1)  # the redis tier refuses: down
            stats = chain.snapshot()
            redis_tier = chain.tiers[1].inner  # under the SealedTier
            assert not redis_tier.is_healthy and redis_tier.last_error
        finally:
            chain.close()
    assert "unreachable" in caplog.text and "***" in caplog.text
    assert SECRET not in caplog.text
    assert SECRET not in repr(stats) and SECRET not in (redis_tier.last_error or "")


@pytest.mark.parametrize("url", [f"redis://:{SECRET}@127.0.0.1:6379/0?foo=bar", f"redis://:{SECRET}@h:99999/0",
                                 f"http://:{SECRET}@h/0", f"redis://:{SECRET}@h/zero"])
def test_a_config_error_about_a_redis_url_hides_the_password(url):
    with pytest.raises(ConfigError) as info:
        load_config(redis_config(url), env={})
    assert info.value.key == "tiers[1].url"
    assert SECRET not in str(info.value) and "***" in str(info.value)


def test_the_config_dump_and_config_check_hide_the_password(tmp_path, capsys):
    url = f"redis://user:{SECRET}@127.0.0.1:6379/0"
    config = load_config(redis_config(url), env={})
    assert to_dict(config)["tiers"][1]["url"] == url  # handed to other processes as it is
    assert SECRET not in repr(shown_dict(config))
    path = tmp_path / "c.yaml"
    path.write_text(f"tiers:\n- kind: cpu\n- kind: redis\n  url: '{url}'\n  trusted: true\n")  # no secret needed
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr()
    assert "user:***@127.0.0.1" in out.out and SECRET not in out.out + out.err
    assert main(["config", "check", "--json", str(path)]) == 0
    assert SECRET not in capsys.readouterr().out
    path.write_text(f"tiers:\n- kind: cpu\n- kind: redis\n  url: '{url}?nope=1'\n  trusted: true\n")
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown query parameter 'nope'" in err and SECRET not in err


MARK = "ZQX"  # opens every generated password: found anywhere in the output, the password leaked


@given(user=st.text(alphabet="abc@:/.-_%", max_size=8),
       secret=st.text(alphabet="abcXYZ019@:/?#%!$&'()*+,;=~ \t", min_size=0, max_size=12),
       tail=st.sampled_from(["host:6379/0", "h/0", "[::1]:7000/1", "a:1,b:2", "/tmp/redis.sock?db=2"]),
       scheme=st.sampled_from(["redis", "rediss", "unix", "redis+cluster"]))
@example(user="_/", secret="?", tail="host:6379/0", scheme="redis")  # a '?' moved ':ZQX' into the database check
@settings(max_examples=400, deadline=None)
def test_no_password_survives_redaction_or_the_config_loader(user, secret, tail, scheme):
    """Any user name and password, '@', '/', ':' and whitespace in them included (found by a shared-tier
    probe: 'redis://ops@corp:PW@host' and 'redis://u:PW x@host' printed PW): the URL redacted whole never
    shows it; the config loader either refuses the URL (its message masked) or keeps one whose password
    a log line's redaction finds."""
    from tierkv.config import ConfigError, load_config

    password = MARK + secret
    url = f"{scheme}://{user}:{password}@{tail}"
    assert MARK not in redact_url(url)
    assert MARK not in redact_value("tiers[1].url", url)
    try:
        config = load_config({"tiers": [{"kind": "cpu"}, {"kind": "redis", "url": url}]}, env={})
    except ConfigError as exc:
        assert MARK not in str(exc)
        return
    assert MARK not in repr(config) and MARK not in str(config)
    assert not any(c.isspace() for c in url)  # accepted: nothing a text's redaction would split
    assert MARK not in redact_text(f"tierkv: redis tier {url} is down: connection refused")


@pytest.mark.parametrize("url", ["redis://host:6379/0?client_name=svc@prod", "unix:///run/redis/redis@6379.sock?db=1",
                                 "rediss://u:pw@h/0?client_name=a@b"])
def test_an_at_sign_outside_the_userinfo_is_accepted(url):
    """The userinfo rule reads only the authority ('@' in a query value or a socket path is theirs)."""
    from tierkv.config import load_config

    tiers = load_config({"tiers": [{"kind": "cpu"}, {"kind": "redis", "url": url}]}, env={}).tiers
    assert tiers[1].url == url
