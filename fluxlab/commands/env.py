import json
import platform
import sys

from omegaconf import DictConfig

from fluxlab.commands._app import hydra_app


def collect_env() -> dict:
    """Versions and device facts that a bug report needs."""
    import importlib.metadata as md

    import torch

    facts = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
             "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
             "cpu_threads": torch.get_num_threads()}
    for pkg in ("fluxlab", "flashinfer-python", "triton", "transformers", "hydra-core", "fastapi",
                "mlflow", "sglang-router"):
        try:
            facts[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            facts[pkg] = None
    if torch.cuda.is_available():
        facts["gpus"] = [
            {"name": torch.cuda.get_device_name(i),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
             "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
            for i in range(torch.cuda.device_count())]
    return facts


def _env(cfg: DictConfig) -> None:
    facts = collect_env()
    if cfg.json:
        print(json.dumps(facts, indent=2))
    else:
        for key, value in facts.items():
            print(f"{key:<18} {value}")


main = hydra_app("env", _env)
