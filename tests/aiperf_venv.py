"""aiperf's own venv for tests/test_standard_clients.py, built once in the fluxlab cache.

aiperf 0.13.0 pins pandas~=2.3.3, rich~=14.1, prometheus-client~=0.23.1 and more below fluxlab's versions, so
docs/bench.md installs it apart and so does this. The build (a pip install, ~50 s on a 2-core machine) used to sit
at the end of `make test`, the last file running alone; conftest.py now starts `python tests/aiperf_venv.py` in the
background when the session begins, and the test waits for it through the same file lock. A build marks the venv
finished last (a venv's scripts name its interpreter by absolute path, so it is built in place, not renamed), so an
interrupted build never passes for a finished one.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "0.13.0"


def venv_dir() -> Path:
    return Path(os.environ.get("FLUXLAB_CACHE", Path.home() / ".cache" / "fluxlab")) / f"aiperf-{VERSION}-venv"


def finished(venv: Path) -> bool:
    return (venv / "bin" / "aiperf").exists() and (venv / "fluxlab-finished").exists()


def needed() -> bool:
    """No `aiperf` on PATH and no finished venv: a build is due."""
    return shutil.which("aiperf") is None and not finished(venv_dir())


def ensure() -> str:
    """The bin/ folder holding `aiperf`: PATH's, else the venv's, built here unless a build holding the lock
    (the background one) finishes it first."""
    found = shutil.which("aiperf")
    if found:
        return str(Path(found).parent)
    venv = venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"aiperf-{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not finished(venv):
            shutil.rmtree(venv, ignore_errors=True)  # an interrupted build (or one from before the mark)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={VERSION}"], check=True,
                           timeout=900)
            (venv / "fluxlab-finished").touch()
    return str(venv / "bin")


if __name__ == "__main__":
    print(ensure())
