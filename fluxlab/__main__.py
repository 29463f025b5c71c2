"""`python -m fluxlab <command> [hydra overrides]`: pops the command, hands the rest to its @hydra.main."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": "HTTP server (OpenAI API) on one machine",
    "bench": "online or offline benchmark; -m or sweep=NAME for sweeps",
    "generate": 'one-shot offline generation: generate prompt="..."',
    "report": "MLflow runs -> reports/<name>/ (markdown + plots)",
    "checkpoint": "write a random-weight HF-format checkpoint: checkpoint preset=tiny out=DIR",
    "env": "torch/cuda/flashinfer/GPU facts, for bug reports",
}

USAGE = "usage: python -m fluxlab <command> [hydra overrides]\n\ncommands:\n" + "".join(
    f"  {name:<11} {text}\n" for name, text in COMMANDS.items()
) + "\n`python -m fluxlab <command> --help` lists the command's groups and every key with its value and meaning; `--cfg job` prints the config.\n"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"fluxlab: unknown command {command!r}\n\n{USAGE}", file=sys.stderr, end="")
        sys.exit(2)
    if command != "bench" and any(a in ("-m", "--multirun") or a.startswith("sweep=") for a in rest):
        print(f"fluxlab {command}: multirun (-m / sweep=) is only for bench; "
              f"{command} runs one configuration", file=sys.stderr)
        sys.exit(2)

    from fluxlab.config.compose import rewrite_aliases

    try:
        overrides = rewrite_aliases(rest)
    except ValueError as err:  # model.path=DIR: no config.json, or a family fluxlab does not serve
        print(f"fluxlab {command}: {err}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"fluxlab {command}"] + overrides
    importlib.import_module(f"fluxlab.commands.{command}").main()


if __name__ == "__main__":
    main()
