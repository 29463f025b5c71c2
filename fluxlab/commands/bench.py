from omegaconf import DictConfig

from fluxlab.commands._app import hydra_app, validated


def _bench(cfg: DictConfig) -> None:
    from fluxlab.bench.run import run_bench

    run_bench(validated(cfg))


main = hydra_app("bench", _bench)
