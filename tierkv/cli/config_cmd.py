"""`tierkv config check [PATH]`: validate a config and print it resolved.

Resolved = defaults filled in and TIERKV_* environment overrides applied (the file defaults to
$TIERKV_CONFIG_FILE, else the built-in defaults). When the config names the model's KV shape
(model.num_layers, num_kv_heads, head_dim and a kv_dtype other than auto), the GPU budget is
also checked against sinks + window and the staging ring, as the runtime would at start-up.
"""
from __future__ import annotations

import json
import sys

import yaml


def add_parser(commands) -> None:
    p = commands.add_parser("config", help="work with tierkv config files", description="Work with tierkv config files.")
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate a config and print it resolved", description=__doc__.splitlines()[0])
    check.add_argument("path", nargs="?", help="YAML config (default: $TIERKV_CONFIG_FILE or the built-in defaults)")
    check.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    check.set_defaults(handler=run_check)


def run_check(args) -> int:
    from tierkv.config import load_config
    from tierkv.config_loader import to_dict

    config = load_config(args.path)
    checked = _check_budget(config)
    data = to_dict(config)
    print(json.dumps(data, indent=2) if args.json else yaml.safe_dump(data, sort_keys=False).rstrip())
    source = args.path or "built-in defaults and TIERKV_* environment"
    extra = "; GPU budget checked against the model's KV shape" if checked else ""
    print(f"tierkv config check: {source}: OK{extra}", file=sys.stderr)
    return 0


def _check_budget(config) -> bool:
    """Raise ConfigError when the budget cannot hold sinks + window or staging one block per region."""
    m = config.model
    if None in (m.num_layers, m.num_kv_heads, m.head_dim) or m.kv_dtype == "auto":
        return False
    from tierkv.cli.plan import KVShape, make_plan

    make_plan(KVShape(m.name, m.num_layers, m.num_kv_heads, m.head_dim, m.kv_dtype), config.cache.block_tokens, config)
    return True
