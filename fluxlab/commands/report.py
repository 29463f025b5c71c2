from omegaconf import DictConfig

from fluxlab.commands._app import hydra_app


def _report(cfg: DictConfig) -> None:
    from fluxlab.bench.report import write_report

    print(write_report(cfg))


main = hydra_app("report", _report)
