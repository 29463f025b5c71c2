import os
import subprocess
import sys
from pathlib import Path

import pytest

import aiperf_venv

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (make test) each worker, and every server it starts, runs torch on one
    # thread: two workers with a thread pool each on a 2-core machine made spinning threads wait
    # on each other (a 24-token request went from 0.3 s to 10 s at load 13).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Path of the tiny checkpoint, written once per test session into a temporary cache."""
    from fluxlab.checkpoint import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("fluxlab_cache"))


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    """(model, config) of the tiny checkpoint in fp32 on CPU."""
    import torch

    from fluxlab.models.llada2.loader import load_model

    return load_model(tiny_ckpt, torch.float32, "cpu", progress=False)


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's ops are far too small for intra-op threads; on a loaded 2-core machine two
    spinning threads made a 256-token generation 15x slower."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def gpu_packages(monkeypatch):
    """Config validation as on a CUDA machine with the [gpu] extra: FlashInfer and FA4 found (CPU CI
    has neither; the tests that refuse a missing package patch these back)."""
    monkeypatch.setattr("fluxlab.config.validate._flashinfer_installed", lambda: True)
    monkeypatch.setattr("fluxlab.config.validate._fa4_installed", lambda: True)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (minutes each: accuracy over every held-out problem, "
                          "the interpreted graph path); `make test` leaves them out to keep the suite near 10 minutes")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with `pytest --slow` (make test ARGS=--slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


_aiperf_build = None  # the background `python tests/aiperf_venv.py` of this session, if one was started


def _runs_standard_clients(config) -> bool:
    """Whether the paths pytest was given include tests/test_standard_clients.py (no path: the whole suite)."""
    target = Path(__file__).with_name("test_standard_clients.py").resolve()
    if config.option.markexpr.strip() == "gpu":
        return False
    paths = [Path(config.invocation_params.dir, a.split("::")[0]).resolve() for a in config.args] or [target]
    return any(p == target or (p.is_dir() and p in target.parents) for p in paths)


def pytest_sessionstart(session):
    # Start aiperf's venv build (~50 s of pip) now, beside the other tests, instead of at the suite's end where
    # test_standard_clients.py ran it alone; the test waits for it through aiperf_venv's file lock.
    global _aiperf_build
    if os.environ.get("PYTEST_XDIST_WORKER") or not _runs_standard_clients(session.config) or not aiperf_venv.needed():
        return
    _aiperf_build = subprocess.Popen([sys.executable, str(Path(__file__).with_name("aiperf_venv.py"))],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def pytest_sessionfinish(session):
    # the test waited for the build if it ran; a build it did not need (a -k that left it out) is stopped
    if _aiperf_build is not None and _aiperf_build.poll() is None:
        _aiperf_build.terminate()
        _aiperf_build.wait(timeout=30)
