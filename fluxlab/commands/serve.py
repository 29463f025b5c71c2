from omegaconf import DictConfig

from fluxlab.commands._app import hydra_app, validated


def _serve(cfg: DictConfig) -> None:
    cfg = validated(cfg)
    from fluxlab.server.launch import serve

    serve(cfg)


main = hydra_app("serve", _serve)
