"""Run a test module's `__main__` checks under the Triton interpreter, in a fresh process.

TRITON_INTERPRET must be set before triton decorates any kernel, whatever this pytest process has
imported already, hence the subprocess.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreter_checks(test_file: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(test_file)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "interpreter checks ok" in proc.stdout
