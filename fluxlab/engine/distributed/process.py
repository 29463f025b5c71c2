"""A TP worker process: `python -m fluxlab.engine.distributed.worker`, a fresh interpreter.

multiprocessing's spawn re-imports the parent's `__main__` in every child, which breaks three
ordinary ways to call `LLM(..., parallel=tp2)`: a script fed on stdin (`<stdin>` is not a file:
FileNotFoundError), a script without an `if __name__ == "__main__"` guard (each worker would run
the user's script again), and a notebook whose main module spawn cannot rebuild. A worker needs
nothing from the user's code, so it is started as its own entry module and can never import it.
Hiding the main path from spawn's preparation data would also work, but it edits a process-wide
global (`sys.modules["__main__"]`) while other threads run and relies on spawn internals.

The same picture as a multiprocessing.Process, built from plain parts: the payload (config, rank,
port, the parent's sys.path) goes over the child's stdin; "ready"/"error" messages come back on a
pipe (a multiprocessing Connection); each step's difference is written to shared memory (a memfd
the child inherits) and its doorbell goes out on another pipe (step_channel.py: a dead reader is a
BrokenPipeError at once); a pidfd is the sentinel that turns readable when the child exits. No
semaphore, queue or named segment is created, so no resource tracker runs and nothing can leak.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional

import fluxlab

ENTRY_MODULE = "fluxlab.engine.distributed.worker"


class WorkerProcess:
    """Started at construction; exitcode follows multiprocessing's rule (-N: killed by signal N)."""

    def __init__(self, rank: int, payload: dict, shared_fd: int):
        """shared_fd: the step channel's shared memory (a memfd), inherited by the child."""
        read_fd, write_fd = os.pipe()
        step_read_fd, step_write_fd = os.pipe()
        env = dict(os.environ)
        # The child imports this very fluxlab (a worktree or an editable install alike).
        package_root = str(Path(fluxlab.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        try:
            self._popen = subprocess.Popen([sys.executable, "-m", ENTRY_MODULE, str(write_fd), str(step_read_fd),
                                            str(shared_fd)],
                                           stdin=subprocess.PIPE, pass_fds=(write_fd, step_read_fd, shared_fd), env=env)
        finally:
            os.close(write_fd)
            os.close(step_read_fd)
        self.rank = rank
        self.pid = self._popen.pid
        self.messages = Connection(read_fd, writable=False)  # EOF once the child has exited
        self.steps = Connection(step_write_fd, readable=False)  # rank 0 -> worker: step doorbells
        self.sentinel = os.pidfd_open(self.pid)
        try:
            self._popen.stdin.write(pickle.dumps({**payload, "rank": rank, "sys_path": list(sys.path)}))
            self._popen.stdin.close()
        except BrokenPipeError:
            pass  # died before reading it: its exit code tells

    @property
    def exitcode(self) -> Optional[int]:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def close(self) -> None:
        """Release the pipe and pidfd (after the process has been joined)."""
        self.messages.close()
        self.steps.close()
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


def read_payload() -> tuple[dict, Connection, Connection, int]:
    """The child's half: the payload from stdin, the message pipe, the step pipe and the step
    channel's shared-memory fd named on argv."""
    payload = pickle.load(sys.stdin.buffer)
    sys.path[:] = payload.pop("sys_path")  # what spawn would restore: site dirs added at run time too
    return (payload, Connection(int(sys.argv[1]), readable=False), Connection(int(sys.argv[2]), writable=False),
            int(sys.argv[3]))
