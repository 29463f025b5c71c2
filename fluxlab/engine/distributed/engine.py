"""ParallelEngine: TP/EP rank 0 in the calling process, tp_size - 1 spawned workers in lockstep.

Rank 0 alone schedules and decodes; before each forward it writes what changed since the last step
(step_channel.py: new seats, page-table edits, changed tokens) to shared memory and rings each
worker's doorbell, then every rank runs the same forward. A worker that dies turns the next
step (or the one in flight) into a RuntimeError naming its rank and exit code; one that fails
while starting is reported with its rank and traceback within parallel.startup_timeout_s.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import socket
import threading
import time
from multiprocessing.connection import wait as wait_sentinels
from typing import TYPE_CHECKING

import torch.distributed as dist

from fluxlab.engine.request import EngineFatalError
from fluxlab.engine.distributed.process import WorkerProcess
from fluxlab.engine.distributed.dp_attention import DataParallelPages, DataParallelRunner
from fluxlab.engine.distributed.step_channel import StepWriter
from fluxlab.engine.distributed.worker import RankEngine, init_distributed, rank_device
from fluxlab.engine.layers.linear import ParallelDims, set_parallel_dims
from fluxlab.models.registry import family_of_model

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("fluxlab.engine")

# After a worker dies mid-step, how long rank 0 waits for its own collective to fail (gloo sees
# the closed socket at once) before aborting the NCCL group, which would otherwise wait out its timeout.
_ABORT_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_config_for(cfg: DictConfig):
    from fluxlab.engine.loading import resolve_model_dir

    return family_of_model(cfg.model).hooks().model_config(resolve_model_dir(cfg.model), cfg.model.preset)


def special_ids_for(cfg: DictConfig):
    from fluxlab.engine.loading import resolve_model_dir

    return family_of_model(cfg.model).hooks().special_ids(resolve_model_dir(cfg.model), preset=cfg.model.preset)


class ParallelEngine(RankEngine):
    isolate_failures = False  # a step that raised may have left a collective half done: fatal

    def __init__(self, cfg: DictConfig):
        from omegaconf import OmegaConf

        par = cfg.parallel
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process; shut it down first")
        self.dp_attention = bool(par.enable_dp_attention)
        model_config = model_config_for(cfg)
        if self.dp_attention and not model_config.num_experts:
            raise ValueError(f"parallel.enable_dp_attention=true needs a MoE model; model={cfg.model.name} has no "
                             "routed experts")
        # before any process starts; under DP attention only the experts are split
        family_of_model(cfg.model).hooks().check_parallel(model_config, 1 if self.dp_attention else par.tp_size, par.ep_size)
        if self.dp_attention:
            self.runner_class = DataParallelRunner
        self.tp_size = par.tp_size
        self.startup_timeout_s = float(par.startup_timeout_s)
        self._failure: str | None = None
        self._worker_errors: dict[int, str] = {}
        self._closed = False
        self._in_step_since: float | None = None
        self._messages_lock = threading.Lock()
        port = free_port()
        container = OmegaConf.to_container(cfg, resolve=True)
        special = special_ids_for(cfg)  # the workers build no tokenizer
        sched, bl = cfg.scheduler, cfg.decoding.block_length
        # TP: one message for all workers; DP attention: each worker its own part of the step.
        self._channels = [StepWriter(sched.max_num_seqs, cfg.model.max_model_len // bl, bl,
                                     sched.max_scheduled_tokens, special.mask_id)
                          for _ in range(par.tp_size - 1 if self.dp_attention else 1)]
        payload = {"cfg": container, "port": port, "special": dataclasses.asdict(special),
                   "channel": self._channels[0].setup()}
        self._workers = {rank: WorkerProcess(rank, payload, self._channel_of(rank).fd)
                         for rank in range(1, par.tp_size)}
        for rank, worker in self._workers.items():
            self._channel_of(rank).pipes.append(worker.steps)
        # Like a daemon process: a script that never calls shutdown() leaves no worker behind.
        atexit.register(self._kill_workers)
        cfg0 = OmegaConf.create(container)
        cfg0.engine.device = rank_device(cfg.engine.device, 0)
        try:
            started = time.monotonic()
            control = self._join_group(cfg0, port)
            super().__init__(cfg0, control)
            self._await_ready(started + self.startup_timeout_s)
        except BaseException as err:
            report = self._failure_report(wait_s=2.0) or f"{type(err).__name__}: {err}"
            self._stop_workers(graceful=False)
            self._leave_group()
            raise RuntimeError(f"tensor-parallel startup failed (parallel.tp_size={par.tp_size}, "
                               f"parallel.ep_size={par.ep_size}): {report}") from err
        self.cfg = cfg
        if self.dp_attention:
            self._spread_over_ranks()
            self.runner.on_step = self._check_workers  # the runner sends each rank its part
        else:
            self.runner.on_step = self._broadcast_step
        self.async_scheduling = False  # every rank runs each step rank 0 decided: nothing launches ahead
        self._monitor = threading.Thread(target=self._watch_workers, name="fluxlab-tp-monitor", daemon=True)
        self._monitor.start()
        log.info("tensor parallel: tp_size=%d ep_size=%d (%s), %d workers ready", par.tp_size, par.ep_size,
                 par.distributed_backend, len(self._workers))

    def _channel_of(self, rank: int) -> StepWriter:
        return self._channels[rank - 1 if self.dp_attention else 0]

    def _spread_over_ranks(self) -> None:
        """DP attention: one block manager per rank behind the one scheduler; the runner steps them all."""
        from fluxlab.engine.block_manager import BlockManager

        pages = self.block_manager.num_pages  # every rank's pool: the same rule, the same count
        c = self.cfg
        managers = [BlockManager(pages, c.engine.kv_cache_layout, pages_per_slot=self.max_model_len // self.block_length,
                                 enable_prefix_cache=c.scheduler.enable_prefix_cache, first_page=rank * pages)
                    for rank in range(self.tp_size)]
        # A seat's request lives on one rank: every rank's pool writes the one page-table mirror the
        # scheduler's seats were built over.
        for manager in managers:
            manager.seat_pages, manager.seat_num_pages = self.block_manager.seat_pages, self.block_manager.seat_num_pages
        self.block_manager = self.scheduler.block_manager = DataParallelPages(managers, pages)
        self.runner.channels, self.runner.pages_per_rank, self.runner.world = self._channels, pages, self.tp_size

    # --- startup ---
    def _join_group(self, cfg0, port: int):
        """init_process_group waits for every rank: wait on it beside the workers' sentinels, so a
        worker that dies before joining is reported at once, not after the rendezvous timeout."""
        result: dict = {}

        def join():
            try:
                result["control"] = init_distributed(cfg0, 0, port)
            except BaseException as err:  # noqa: BLE001
                result["error"] = err

        joiner = threading.Thread(target=join, name="fluxlab-tp-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.2)
            if joiner.is_alive() and self._dead_workers():
                raise RuntimeError(self._failure_report(wait_s=1.0))
        if "error" in result:
            raise result["error"]
        return result["control"]

    def _await_ready(self, deadline: float) -> None:
        pending = set(self._workers)
        while pending:
            messages = self._poll_messages(timeout=0.2)
            for kind, rank, detail in messages:
                if kind == "error":
                    self._worker_errors[rank] = detail
                    raise RuntimeError(self._failure_report(wait_s=1.0))
                pending.discard(rank)
            if messages:
                continue
            if self._dead_workers():
                raise RuntimeError(self._failure_report(wait_s=1.0))
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel rank(s) {sorted(pending)} not ready within "
                                   f"parallel.startup_timeout_s={self.startup_timeout_s:g}")

    # --- failures ---
    def _poll_messages(self, timeout: float) -> list[tuple]:
        """The (kind, rank, detail) messages the workers sent within timeout; a closed pipe (its
        worker exited) sends nothing."""
        with self._messages_lock:  # the monitor thread reads them too
            pipes = [w.messages for w in self._workers.values() if not w.messages.closed]
            got = []
            for pipe in wait_sentinels(pipes, timeout=timeout):
                try:
                    got.append(pipe.recv())
                except (EOFError, OSError):
                    pipe.close()
            return got

    def _dead_workers(self) -> dict[int, int]:
        return {rank: p.exitcode for rank, p in self._workers.items() if p.exitcode is not None}

    def _failure_report(self, wait_s: float = 0.0) -> str:
        """Which ranks died (exit codes) and the tracebacks they sent, waiting up to wait_s for them."""
        deadline = time.monotonic() + wait_s
        errors = self._worker_errors  # kept: a report may be asked for twice
        while True:
            messages = self._poll_messages(timeout=0.05)
            for kind, rank, detail in messages:
                if kind == "error":
                    errors[rank] = detail
            if messages:
                continue
            if errors or self._dead_workers() or time.monotonic() > deadline:
                break
        dead = self._dead_workers()
        parts = [f"tensor-parallel worker rank {rank} exited with code {code}" for rank, code in sorted(dead.items())]
        parts += [f"rank {rank} reported:\n{tb}" for rank, tb in sorted(errors.items())]
        return "; ".join(parts)

    def _watch_workers(self) -> None:
        """Notice a worker's death at once (not at the next step) and unblock a stuck NCCL step."""
        sentinels = {p.sentinel: rank for rank, p in self._workers.items()}
        while sentinels and not self._closed:
            try:
                ready = wait_sentinels(list(sentinels), timeout=1.0)
            except (OSError, ValueError):  # shutdown closed the pidfds under us
                return
            if self._closed or not ready:
                continue
            self._failure = self._failure_report(wait_s=0.5)
            log.error("%s", self._failure)
            if self.cfg.parallel.distributed_backend == "nccl":
                time.sleep(_ABORT_GRACE_S)
                if self._in_step_since is not None:
                    self._abort_group()
            return

    def _abort_group(self) -> None:
        try:
            import torch

            dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda")).abort()
        except Exception:  # noqa: BLE001 - best effort: the timeout still ends the wait
            log.exception("could not abort the NCCL group")

    # --- the step ---
    def _check_workers(self, inputs=None) -> None:
        if self._failure is not None or self._dead_workers():
            raise EngineFatalError(self._failure or self._failure_report(wait_s=0.5))

    def _broadcast_step(self, inputs) -> None:
        self._check_workers()
        self._channels[0].send(inputs)  # BrokenPipeError if a worker is gone

    @property
    def step_bytes_sent(self) -> int:
        """Bytes rank 0 has sent the workers on the step channel (all workers, doorbells included)."""
        return sum(c.bytes_sent for c in self._channels)

    def step(self):
        if self._closed:
            raise RuntimeError("the tensor-parallel engine is shut down")
        self._in_step_since = time.monotonic()
        try:
            return super().step()
        except Exception as err:
            if self._failure is None:
                report = self._failure_report(wait_s=2.0)
                if not report:
                    raise
                self._failure = report
            raise EngineFatalError(self._failure) from err
        finally:
            self._in_step_since = None

    # --- shutdown ---
    def shutdown(self) -> None:
        super().shutdown()
        if self._closed:
            return
        self._stop_workers(graceful=True)
        self.runner.release_graphs()
        self._leave_group()

    def _stop_workers(self, graceful: bool) -> None:
        self._closed = True
        if graceful and not self._dead_workers() and self._failure is None:
            try:
                for channel in self._channels:
                    channel.send_shutdown()
            except Exception:  # noqa: BLE001
                log.exception("could not send shutdown to the workers")
        deadline = time.monotonic() + (10.0 if graceful else 0.0)
        for process in self._workers.values():
            process.join(max(0.0, deadline - time.monotonic()))
        self._kill_workers()
        for channel in self._channels:
            channel.close()

    def _kill_workers(self) -> None:
        for process in self._workers.values():
            if process.is_alive():
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()
            process.close()
        atexit.unregister(self._kill_workers)

    @staticmethod
    def _leave_group(timeout_s: float = 15.0) -> None:
        """Leave the TP group, never hanging: NCCL communicators are aborted rather than finalized
        (a graceful destroy waits on peers that may be gone and was seen to hang at shutdown on
        2 H200s), and the teardown gets timeout_s before the process carries on without it."""
        if dist.is_initialized():
            def leave() -> None:
                try:
                    if dist.get_backend() == "nccl":
                        dist.distributed_c10d._abort_process_group()
                    else:
                        dist.destroy_process_group()
                except Exception:  # noqa: BLE001
                    log.exception("leaving the tensor-parallel group failed")

            leaver = threading.Thread(target=leave, name="fluxlab-tp-leave", daemon=True)
            leaver.start()
            leaver.join(timeout_s)
            if leaver.is_alive():
                log.warning("the tensor-parallel group did not shut down within %.0f s; going on without it",
                            timeout_s)
        set_parallel_dims(ParallelDims())
