import logging

from omegaconf import DictConfig

from fluxlab.commands._app import hydra_app, validated


def _bench(cfg: DictConfig) -> None:
    from fluxlab.bench.run import Job, run_bench

    if not Job.current().multirun:
        run_bench(validated(cfg))
        return
    # One refused point of a sweep is a failed job, recorded like one; the sweep goes on.
    from fluxlab.bench.run import record_refused_job
    from fluxlab.config import ConfigError, validate_config

    try:
        notes = validate_config(cfg)
    except ConfigError as err:
        record_refused_job(cfg, f"config error: {err}")
        return
    for note in notes:
        logging.getLogger("fluxlab").info("config: %s", note)
    run_bench(cfg)


main = hydra_app("bench", _bench)
