"""`python -m fluxlab <command> --help`: the command's groups with their options, then every key with
the value this command line would run with and its one line from the schema (schema.py `key`).

Written here rather than through Hydra's help template: Hydra lists groups by rebuilding its config
repository once per group and option (a deep copy of the whole ConfigStore each time), seconds of
CPU for a page of text; the folders are read directly instead.
"""
from __future__ import annotations

import shutil
import textwrap
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf

from fluxlab.config.compose import compose
from fluxlab.config.paths import CONF_DIR, GROUP_ALIASES, PROJECT_ROOT
from fluxlab.config.overrides import command_groups
from fluxlab.config.schema import COMMAND_SCHEMAS, SchemaKey, schema_keys

ALIAS_OF = {group: alias for alias, group in GROUP_ALIASES.items()}


def _group_roots(group: str, searchpath: Sequence[str]) -> list[Path]:
    roots = [PROJECT_ROOT / group] if group in ALIAS_OF else [CONF_DIR / group]
    roots += [Path(entry[len("file://"):]) / group for entry in searchpath if entry.startswith("file://")]
    return roots


def group_options(group: str, searchpath: Sequence[str] = ()) -> list[str]:
    """The options of a group: its YAML files in conf/ (recipes/, sweeps/ beside it) and on hydra.searchpath."""
    return sorted({path.stem for root in _group_roots(group, searchpath) if root.is_dir()
                   for path in root.glob("*.yaml")})


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_show(item) for item in value) + "]"
    return str(value)


def _lookup(values: dict, name: str) -> Any:
    for part in name.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


def _column(rows: list[tuple[str, str]]) -> int:
    return min(max((len(left) for left, _ in rows), default=0), 40) + 2


def _rows(rows: list[tuple[str, str]], width: int, indent: str = "  ", column: int = 0) -> list[str]:
    """`left  help` with the help column aligned and wrapped; a left part too long for the column
    puts its help on the next line."""
    column = column or _column(rows)
    wrap = max(width - len(indent) - column, 30)
    lines = []
    for left, text in rows:
        parts = textwrap.wrap(text, wrap, break_long_words=False, break_on_hyphens=False) or [""]
        if len(left) + 2 > column:
            lines.append(indent + left)
            lines += [indent + " " * column + part for part in parts]
        else:
            lines.append(indent + left.ljust(column) + parts[0])
            lines += [indent + " " * column + part for part in parts[1:]]
    return lines


def command_help(command: str, overrides: Sequence[str] = ()) -> str:
    """The help page of a command, with the given overrides applied to the values it shows."""
    from fluxlab.__main__ import COMMANDS

    width = min(shutil.get_terminal_size((100, 24)).columns, 120)
    cfg = compose(command, overrides, return_hydra_config=True)
    choices = cfg.hydra.runtime.choices
    searchpath = list(cfg.hydra.searchpath)
    groups = command_groups(command)
    lines = [f"usage: python -m fluxlab {command} [GROUP=OPTION ...] [KEY=VALUE ...] [--cfg job] [--help]",
             "", f"{command}: {COMMANDS[command]}", ""]

    if groups:
        lines.append("Groups (GROUP=OPTION; * = chosen):")
        rows = []
        for group in groups:
            chosen = choices.get(group) if group in choices else None
            options = [f"{option}*" if option == chosen else option for option in group_options(group, searchpath)]
            rows.append((ALIAS_OF.get(group, group), ", ".join(options) or "(none)"))
        lines += _rows(rows, width) + [""]

    lines.append("Keys (KEY=VALUE; each shown with the value it has on this command line):")
    values = OmegaConf.to_container(cfg, resolve=False)  # `${...}` as written: resolving may need a GPU or a file
    top: list[tuple[str, str]] = []
    sections: list[tuple[SchemaKey, list[tuple[str, str]]]] = []
    for item in schema_keys(COMMAND_SCHEMAS[command]):
        if "." not in item.name and item.section is not None:
            sections.append((item, []))
        elif item.section is None:
            row = (f"{item.name}={_show(_lookup(values, item.name))}", item.help)
            (sections[-1][1] if "." in item.name else top).append(row)
    column = _column([row for _, rows in sections for row in rows] + top)
    for section, rows in sections:
        chosen = f" ({section.name}={choices[section.name]})" if section.name in choices else ""
        lines += ["", f"  {section.name}{chosen}: {section.help}"] + _rows(rows, width, "    ", column)
    if top:
        lines += [""] + _rows(top, width, "    ", column)
    lines += ["", "Values show `${...}` as written (--cfg job --resolve resolves them). Runs write their log and",
              "resolved config to ~/.cache/fluxlab/runs/<command>/<time> ($FLUXLAB_CACHE/runs; hydra.run.dir=DIR)."]
    return "\n".join(lines)
