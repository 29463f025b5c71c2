"""Config schema (structured dataclasses), composition and the one cross-field validation."""
from fluxlab.config.compose import compose
from fluxlab.config.paths import CONF_DIR, PROJECT_ROOT
from fluxlab.config.validate import ConfigError, validate_config

__all__ = ["CONF_DIR", "PROJECT_ROOT", "compose", "ConfigError", "validate_config"]
