"""Shared wiring of the command apps: the @hydra.main decorator on conf/<command>.yaml and validation."""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable

import hydra
from omegaconf import DictConfig

from fluxlab.config import CONF_DIR, ConfigError, validate_config
from fluxlab.config.overrides import check_overrides
from fluxlab.config.schema import register_configs

log = logging.getLogger("fluxlab")


def hydra_app(command: str, body: Callable[[DictConfig], object]) -> Callable[[], None]:
    """A `main()` that runs `body` under @hydra.main with conf/<command>.yaml as primary config."""

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=command)
    def _run(cfg: DictConfig) -> object:
        try:
            return body(cfg)
        except (ValueError, FileNotFoundError) as err:
            # A bad path, a missing or misshapen weight, a model that does not fit the parallel
            # layout: the message says what to change; FLUXLAB_DEBUG=1 shows the traceback.
            if os.environ.get("FLUXLAB_DEBUG"):
                raise
            print(f"fluxlab {command}: {err}", file=sys.stderr)
            sys.exit(2)

    def main() -> None:
        from hydra._internal.utils import get_args_parser

        register_configs()
        args = get_args_parser().parse_args(sys.argv[1:])  # the parser @hydra.main uses next
        try:
            check_overrides(command, args.overrides)
            if args.help:
                from fluxlab.config.help import command_help

                print(command_help(command, args.overrides))
                return
        except ConfigError as err:
            print(f"fluxlab {command}: {err}", file=sys.stderr)
            sys.exit(2)
        _run()

    return main


def validated(cfg: DictConfig) -> DictConfig:
    """Validate a run config; a broken rule ends the command with its message (exit 2), no traceback."""
    try:
        notes = validate_config(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    for note in notes:
        log.info("config: %s", note)
    return cfg
