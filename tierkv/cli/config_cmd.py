"""`tierkv config check [PATH ...]`: validate configs and print them resolved.

Resolved = defaults filled in and TIERKV_* environment overrides applied (with no path, the
file is $TIERKV_CONFIG_FILE, else the built-in defaults). Every error of every file is
reported, one line each, naming the file and the key; the exit code is 2 when any file has
one. When a config names the model's KV shape (model.num_layers, num_kv_heads, head_dim and a
kv_dtype other than auto), the GPU budget is also checked against sinks + window and the
staging ring, as the runtime would at start-up. What a start refuses is refused too, through the
start's own checks and creating nothing: an untrusted disk or Redis tier without a secret,
`encrypt: true` on a trusted tier, a secret file that cannot be read (or, with
create_secret_file, created), a disk tier directory of another user or writable by group or
others, a control endpoint without a token of 16 characters. Sizes print as bytes with a
human-readable comment; secrets (passwords in URLs, fields named like secrets) print as ***.
"""
from __future__ import annotations

import json
import os
import re
import sys

from tierkv.config.yaml_reader import dump_yaml
from tierkv.units import format_bytes

_SIZE_LINE = re.compile(r"^(?P<head>\s*(?:- )?\w+_bytes: )(?P<num>\d+)$")


def add_parser(commands) -> None:
    p = commands.add_parser("config", help="work with tierkv config files", description="Work with tierkv config files.")
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate configs and print them resolved", description=__doc__.splitlines()[0])
    check.add_argument("paths", nargs="*", metavar="PATH",
                       help="YAML configs (default: $TIERKV_CONFIG_FILE or the built-in defaults)")
    check.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    check.set_defaults(handler=run_check)


def run_check(args) -> int:
    sources = args.paths or [None]
    resolved: dict[str, dict] = {}
    num_bad = 0
    for path in sources:
        source = _label(path)
        data, errors, checked = check_one(path)
        for err in errors:
            print(f"tierkv config check: error: {source}: {err}", file=sys.stderr)
        if errors:
            num_bad += 1
            continue
        resolved[source] = data
        extra = "; GPU budget checked against the model's KV shape" if checked else ""
        print(f"tierkv config check: {source}: OK{extra}", file=sys.stderr)
    _print_resolved(resolved, args.json, several=len(sources) > 1)
    if len(sources) > 1:
        print(f"tierkv config check: {len(sources) - num_bad} of {len(sources)} configs OK", file=sys.stderr)
    return 2 if num_bad else 0


def _label(path: str | None) -> str:
    """What the messages call the config read from `path`: the path, "PATH ''" for an empty one (the loader
    refuses it), else where the config with no path comes from."""
    if path is not None:
        return path or "PATH ''"
    from_env = os.environ.get("TIERKV_CONFIG_FILE")
    if from_env:
        return f"$TIERKV_CONFIG_FILE {from_env} and TIERKV_* environment"
    return "built-in defaults and TIERKV_* environment"


def check_one(path: str | None) -> tuple[dict | None, list, bool]:
    """(resolved config as printable data, every ConfigError, whether the budget was checked)."""
    from tierkv.config import ConfigError, config_errors, load_config
    from tierkv.config.load import shown_dict

    errors = config_errors(path)
    if errors:
        return None, errors, False
    config = load_config(path)
    try:
        checked = _check_budget(config)
        _check_start(config)
    except ConfigError as err:
        return None, [err], False
    return shown_dict(config), [], checked


def _check_start(config) -> None:
    """Refuse what a start refuses beyond the loader's checks, through the start's own functions and creating
    nothing: per tier, `encrypt` on a trusted tier and a sealed tier without any secret; the secret file where a
    start reads it (an untrusted disk or Redis tier), or where it would create it; an existing disk tier directory
    of another user or writable by group or others; a control endpoint without a usable token."""
    from tierkv.storage.auth import check_tier_secret, is_sealed
    from tierkv.storage.secret_file import check_storage_secret

    for index, tier in enumerate(config.tiers):
        check_tier_secret(index, tier, config.storage)
        if tier.kind == "disk":
            _check_disk_directory(index, tier)
    if any(is_sealed(t) for t in config.tiers):
        check_storage_secret(config.storage)
    if config.metrics.control_enabled:
        from tierkv.metrics.control import BudgetControl

        BudgetControl.from_config(config.metrics, lambda num_bytes: None, env=os.environ)  # the token's checks


def _check_disk_directory(index: int, tier) -> None:
    """The disk tier's directory, when it exists, refused in the words of a start (`open_private_directory`,
    which would make a missing one 0700 and tighten a readable one: a check changes nothing)."""
    from tierkv.config import ConfigError
    from tierkv.config.paths import expand_path
    from tierkv.storage.disk_files import directory_refusal

    path = expand_path(tier.path, f"tiers[{index}].path")
    try:
        link, st = os.lstat(path), os.stat(path)
    except OSError:  # missing: made 0700 at start (the loader checked that it can be)
        return
    problem = directory_refusal(path, link, st)
    if problem is not None:
        raise ConfigError(f"tiers[{index}].path", tier.path, f"{tier.kind}: {problem}")


def _print_resolved(resolved: dict[str, dict], as_json: bool, *, several: bool) -> None:
    if as_json:
        if resolved:
            print(json.dumps(resolved if several else next(iter(resolved.values())), indent=2))
        return
    for source, data in resolved.items():
        if several:
            print(f"--- # {source}")
        print(with_sizes(dump_yaml(data, sort_keys=False).rstrip()))


def with_sizes(text: str) -> str:
    """YAML lines `*_bytes: N` with a comment giving N human-readable: `# 2.00 GiB (2147483648 bytes)`."""
    lines = []
    for line in text.splitlines():
        match = _SIZE_LINE.match(line)
        if match:
            num = int(match["num"])
            line = f"{line}  # {format_bytes(num)} ({num} bytes)"
        lines.append(line)
    return "\n".join(lines)


def _check_budget(config) -> bool:
    """Raise ConfigError when the budget cannot hold sinks + window or staging one block per region."""
    m = config.model
    if None in (m.num_layers, m.num_kv_heads, m.head_dim) or m.kv_dtype == "auto":
        return False
    from tierkv.cli.plan import KVShape, make_plan

    make_plan(KVShape(m.name, m.num_layers, m.num_kv_heads, m.head_dim, m.kv_dtype), config.cache.block_tokens, config)
    return True
