"""Local sweep jobs on separate GPUs: each job claims a free group of GPUs through lock files.

submitit's local executor starts every job at once and gives each the same first GPUs
(CUDA_VISIBLE_DEVICES=0..gpus_per_node-1; hydra issue #2757). A job instead takes an aligned group
of the GPUs the sweep saw, as many as its engine needs, holding one `flock` per GPU until its
process ends; when every group is taken it waits, so a GPU runs one job at a time.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from typing import IO

log = logging.getLogger("fluxlab.bench")

_held: list[IO] = []  # open lock files: closing one (or the process ending) frees its GPU


def _try_lock(lock_dir: Path, gpus: list[str]) -> bool:
    taken: list[IO] = []
    for gpu in gpus:
        handle = open(lock_dir / f"gpu-{gpu}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            for other in taken:
                other.close()
            return False
        taken.append(handle)
    _held.extend(taken)
    return True


def claim_gpus(pool: list[str], need: int, lock_dir: Path, job_num: int, poll_s: float = 0.5) -> list[str]:
    """Block until `need` GPUs of `pool` are free, lock them for this process and return them.

    Groups are aligned (pool[0:need], pool[need:2*need], ...) so a multi-GPU engine gets neighbours;
    job k tries group k first, so a sweep no larger than the pool starts without contention.
    """
    if need < 1 or need > len(pool):
        raise ValueError(f"a job needs {need} GPUs; the sweep has {len(pool)}: {','.join(pool) or 'none'}")
    lock_dir.mkdir(parents=True, exist_ok=True)
    groups = [pool[i:i + need] for i in range(0, len(pool) - need + 1, need)]
    first = job_num % len(groups)
    order = groups[first:] + groups[:first]
    waited = False
    while True:
        for group in order:
            if _try_lock(lock_dir, group):
                return group
        if not waited:
            log.info("job %d waits for %d free GPU(s) of %s", job_num, need, ",".join(pool))
            waited = True
        time.sleep(poll_s)


def release_gpus() -> None:
    while _held:
        _held.pop().close()


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
