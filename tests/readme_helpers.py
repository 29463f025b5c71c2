"""The README's fenced blocks and `$ command` lines, read by the tests that run them as printed."""
from __future__ import annotations

import re

from fluxlab.config import PROJECT_ROOT

README = (PROJECT_ROOT / "README.md").read_text()


def code_block(heading: str, lang: str = "") -> str:
    """The first fenced block after `heading` in the README."""
    start = README.index(heading)
    found = re.compile(rf"```{lang}\n(.*?)```", re.S).search(README, start)
    assert found, f"no ```{lang} block after {heading!r}"
    return found.group(1)


def shell_commands(block: str) -> list[tuple[str, list[str]]]:
    """`$ command` lines (with their backslash-continued lines) with the output lines printed under each."""
    commands: list[tuple[str, list[str]]] = []
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):  # kept as printed: bash joins the lines
                i += 1
                command += "\n" + lines[i]
            commands.append((command, []))
        elif commands:
            commands[-1][1].append(line)
        i += 1
    return commands


def without_comment(command: str) -> str:
    return re.split(r"\s+#\s", command, maxsplit=1)[0].strip()


def first_run(prefix: str) -> tuple[str, list[str]]:
    [found] = [(c, out) for c, out in shell_commands(code_block("## First run")) if c.startswith(prefix)]
    return found
