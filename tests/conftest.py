import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Path of the tiny checkpoint, written once per test session into a temporary cache."""
    from fluxlab.checkpoint import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("fluxlab_cache"))


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    """(model, config) of the tiny checkpoint in fp32 on CPU."""
    import torch

    from fluxlab.engine.loader import load_model

    return load_model(tiny_ckpt, torch.float32, "cpu", progress=False)
