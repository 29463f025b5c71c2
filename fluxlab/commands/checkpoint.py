from pathlib import Path

from omegaconf import DictConfig

from fluxlab.commands._app import hydra_app


def _checkpoint(cfg: DictConfig) -> None:
    from fluxlab.checkpoint import write_checkpoint

    out = Path(cfg.out) if cfg.out else Path("checkpoints") / cfg.preset
    print(write_checkpoint(cfg.preset, out, seed=cfg.seed, dtype=cfg.dtype))


main = hydra_app("checkpoint", _checkpoint)
