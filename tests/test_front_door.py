"""The README's first command as a user runs it, with the default model and no overrides.

`fluxlab serve` failed for ~20 commits while every server test served tiny_llada2: the engine
process (spawned) composed nothing, so the default model's `${fluxlab_asset:...}` path could not
resolve there. These tests start the real thing: a fresh venv with `pip install .` (not editable)
serving from another folder, `make serve` from the checkout, and each path that hands the config to
another process (engine process, TP workers, DP replicas) with the default model. Each asks the
embedded model a question from its task and checks the answer.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

from fluxlab.config import PROJECT_ROOT
from readme_helpers import first_run, without_comment

QUESTION = {"model": "arith_llada2", "messages": [{"role": "user", "content": "What is 12 + 30?"}]}
ANSWER = "12 + 30 = 42. The answer is 42."
HEALTH_WITHIN_S = 60.0
README_PORT = 8000  # `fluxlab serve` with no overrides listens here


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What `make test ARGS=...` exports to its children; a user's shell running the README's `make serve` has none
# (with them, `make serve` would take the test run's ARGS as serve overrides).
MAKE_VARIABLES = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS")


def _user_env(extra: dict | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MAKE_VARIABLES}
    return {**env, **(extra or {})}


class Served:
    """A command that serves on `port`, its output in a log file; stopped with SIGTERM."""

    def __init__(self, argv: list[str], cwd: Path, port: int, log_path: Path, env: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=_user_env(env), start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until /health answered 200; fails with the log if it does not in time or the command exits."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                pytest.fail(f"exited with code {self.proc.returncode} before /health answered:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"/health did not answer within {timeout_s:.0f} s:\n{self.log()[-4000:]}")

    def ask(self) -> str:
        response = httpx.post(self.url + "/v1/chat/completions", json=QUESTION, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """`sig` to the whole group, as Ctrl-C (SIGINT) or systemd's stop (SIGTERM) deliver it; the exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"did not stop within 60 s of SIGTERM:\n{self.log()[-3000:]}")
        finally:
            self._log.close()


def readme_port_or_skip() -> int:
    if not port_is_free(README_PORT):
        pytest.fail(f"port {README_PORT} is taken: the README's `fluxlab serve` (no overrides) listens there; "
                    "stop what holds it to run this test")
    return README_PORT


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv holding `pip install .` of this checkout (a wheel build, not editable). The
    dependencies come from this test's environment through a .pth file, so pip resolves them as
    installed instead of downloading gigabytes; fluxlab itself is only in the venv's site-packages."""
    venv = tmp_path_factory.mktemp("wheel") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                           text=True).strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "zz_test_environment.pth").write_text("\n".join(sorted(ours)) + "\n")
    had_build_dir = (PROJECT_ROOT / "build").exists()
    install = subprocess.run([python, "-m", "pip", "install", "-q", "."], cwd=PROJECT_ROOT, capture_output=True,
                             text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    assert had_build_dir or not (PROJECT_ROOT / "build").exists(), "`pip install .` left build/ in the checkout"
    return venv


def test_pip_install_then_fluxlab_serve_from_another_folder_answers(wheel_venv, tmp_path):
    """README: `pip install .` puts everything in the package, so `fluxlab serve` works from any directory."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": f"{wheel_venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(wheel_venv),
           "PYTHONPATH": ""}
    where = subprocess.run(["python", "-c", "import fluxlab; print(fluxlab.__file__)"], cwd=elsewhere, env={**os.environ, **env},
                           capture_output=True, text=True, check=True)
    assert where.stdout.strip().startswith(str(wheel_venv)), where.stdout  # the installed copy, not the checkout
    serve, _ = first_run("fluxlab serve")
    assert without_comment(serve) == "fluxlab serve"
    served = Served(["fluxlab", "serve"], elsewhere, readme_port_or_skip(), tmp_path / "serve.log", env)
    try:
        served.wait_healthy(HEALTH_WITHIN_S)
        assert served.ask() == ANSWER
        curl, shown = first_run("curl")
        reply = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120, check=True).stdout
        expected = shown[0].strip().removeprefix("...").removesuffix("...").strip()
        assert expected and expected in reply, (expected, reply)
    finally:
        code = served.stop()
    assert code == 0, served.log()[-3000:]
    assert "fluxlab ready: http://0.0.0.0:8000" in served.log()
    assert sorted(p.name for p in elsewhere.iterdir()) == [], "serve wrote files into the folder it was run from"


def test_make_serve_from_the_checkout_answers(tmp_path):
    """README: `make serve` installs once (a stamp per environment), then serves the embedded model on :8000."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed; the README's set-up needs it")
    bin_dir = str(Path(sys.executable).parent)  # the Makefile's `python3` is this test's interpreter
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable}
    served = Served(["make", "serve"], PROJECT_ROOT, readme_port_or_skip(), tmp_path / "make_serve.log", env)
    try:
        served.wait_healthy(HEALTH_WITHIN_S + 240)  # a first `make` installs the package (about a minute) first
        assert served.ask() == ANSWER
    finally:
        served.stop(signal.SIGINT)  # Ctrl-C
    assert "fluxlab ready: http://0.0.0.0:8000" in served.log()


@pytest.mark.parametrize("parallel", ["tp2", "dp2"])
def test_parallel_layouts_serve_the_default_model(parallel, tmp_path):
    """TP workers and DP replicas get the config from the serve process: with the default model
    (whose path is an interpolation) each must load it and answer."""
    port = free_port()
    argv = [sys.executable, "-m", "fluxlab", "serve", f"parallel={parallel}", f"server.port={port}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    served = Served(argv, tmp_path, port, tmp_path / "serve.log")
    try:
        served.wait_healthy(HEALTH_WITHIN_S + 60)  # two engines load on two shared cores
        assert served.ask() == ANSWER
    finally:
        code = served.stop()
    assert code == 0, served.log()[-3000:]


def test_online_bench_serves_and_scores_the_default_model(tmp_path):
    """docs/bench.md's `bench bench=online`: bench starts `fluxlab serve` from its own resolved config
    (another process), with the default model, and scores its answers."""
    assert "python -m fluxlab bench bench=online " in (PROJECT_ROOT / "docs" / "bench.md").read_text()
    argv = [sys.executable, "-m", "fluxlab", "bench", "bench=online", "workload.num_prompts=4", "tracking=none"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"│ completed\s+│\s+4 │", done.stdout), done.stdout
    assert re.search(r"│ accuracy\s+│\s+1 │", done.stdout), done.stdout  # 4 of the 4 held-out problems
