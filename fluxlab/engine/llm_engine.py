"""The engine loop: schedule -> run -> decode -> postprocess, one forward per `step()`.

Not thread-safe: the server drives it from one thread (fluxlab/server/async_engine.py).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

import torch

from fluxlab.engine.block_manager import BlockManager
from fluxlab.engine.decoding.knobs import above_ceiling, work_ceilings
from fluxlab.engine.decoding.registry import DECODERS, KNOBS, get_decoder
from fluxlab.engine.graph_runner import graph_segment_sizes
from fluxlab.engine.kv_budget import KVBudget
from fluxlab.engine.loading import load_engine_model, load_tokenizer, resolve_model_dir
from fluxlab.engine.model_runner import ModelRunner
from fluxlab.engine.request import EngineFatalError, InvalidRequest, RequestOutput, SamplingParams, next_request_id
from fluxlab.engine.batch import ScheduledBatch, StepOutput
from fluxlab.engine.scheduler import Scheduler
from fluxlab.engine.sequence import Request
from fluxlab.engine.stop import StopStrings
from fluxlab.models.registry import FAMILY_KNOBS, family_of_model, owner_of

if TYPE_CHECKING:  # the engine runs on a bare torch machine: no hydra/omegaconf import at run time
    from omegaconf import DictConfig

log = logging.getLogger("fluxlab.engine")

class LLMEngine(KVBudget):
    runner_class = ModelRunner  # data-parallel attention's rank 0 runs a subclass
    generation_defaults: dict = {}  # the checkpoint's own knob values (Diffusion-Gemma's generation_config.json)
    request_knobs = tuple(k for k in KNOBS if k not in FAMILY_KNOBS)  # the knobs a request to this engine may set

    def __init__(self, cfg: DictConfig):
        self.family = family_of_model(cfg.model)
        family = self.family.hooks()
        self._init_device(cfg)
        free_at_start = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        model_dir = resolve_model_dir(cfg.model)
        self.tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
        # Random weights of a published preset have no files: the preset's released ids.
        self.special = family.special_ids(model_dir, preset=cfg.model.preset)
        self.mask_id, self.eos_id = self.special.mask_id, self.special.eos_id
        self.eos_ids = self.special.stop_ids  # a request stops on any of them
        missing = self._missing_special_ids(cfg.decoding.decoder)
        if missing:
            raise ValueError(f"decoding.decoder={cfg.decoding.decoder} needs the model's {' and '.join(missing)} "
                             f"(config.json delete_token_id/split_token_id: an LLaDA2.2 checkpoint); "
                             f"model={cfg.model.name} has none")
        # Edit tokens are instructions to a decoder, never output (whatever the decoder).
        self.hidden_ids = tuple(i for i in (self.special.delete_id, self.special.split_id) if i is not None)
        self.model, self.model_config = load_engine_model(cfg, self.device, self.dtype, model_dir)
        self.block_length = cfg.decoding.block_length
        family.check_block_length(self.model_config, self.block_length)
        self.max_model_len = cfg.model.max_model_len
        num_pages = self._num_kv_pages(free_at_start)
        layout = cfg.engine.kv_cache_layout
        self.block_manager = BlockManager(num_pages, layout, pages_per_slot=self.max_model_len // self.block_length,
                                          enable_prefix_cache=cfg.scheduler.enable_prefix_cache,
                                          num_seats=cfg.scheduler.max_num_seqs,
                                          max_blocks_per_seq=-(-self.max_model_len // self.block_length))
        self.scheduler = Scheduler(cfg.scheduler.policy, cfg.scheduler.max_num_seqs,
                                   cfg.scheduler.max_scheduled_tokens, self.block_length, self.block_manager,
                                   StopStrings(self.tokenizer), request_timeout_s=cfg.server.request_timeout_s)
        self.runner = self.make_runner(cfg.attention.backend)
        segment_sizes = graph_segment_sizes(cfg)
        if segment_sizes:
            self.runner.capture_graphs(segment_sizes, cfg.attention.cuda_graph_decode_mode)
        self._init_requests()
        # the config's null resolves in validate_config; a config that skipped it runs synchronously
        self.async_scheduling = bool(cfg.scheduler.get("async_scheduling")) and self.runner.on_step is None
        log.info("engine ready: %s on %s (%s), %d KV pages of %d tokens, policy=%s, backend=%s, prefix cache %s",
                 cfg.model.name, self.device, cfg.engine.dtype, self.block_manager.num_pages, self.block_length,
                 cfg.scheduler.policy, cfg.attention.backend, "on" if cfg.scheduler.enable_prefix_cache else "off")

    def make_runner(self, backend: str) -> ModelRunner:
        """A runner of this engine's model with attention `backend` and its own empty KV pages, as many
        as the block manager hands out: the engine's own, and what benchmarks and backend tests swap
        in for `self.runner` (without the prefix cache: cached blocks would point at the old pages)."""
        cfg = self.cfg
        return self.runner_class(self.model, self.block_manager.num_pages, self.block_length, self.device,
                                 self.dtype, backend, self.max_model_len // self.block_length,
                                 cfg.scheduler.max_num_seqs, self.mask_id, self._decoder_special_ids(),
                                 kv_cache_dtype=cfg.model.kv_cache_dtype)

    def _init_requests(self) -> None:
        """The engine loop's own state: live requests, pending outputs and the run's counters."""
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborts, reported by the next step()
        # add_request reads the config's decoding defaults: a plain dict (an omegaconf lookup is ~10 µs)
        self.decoding_defaults: dict = {key: self.cfg.decoding[key] for key in self.cfg.decoding}
        # the most a request may ask of each knob that multiplies its work (decoding.<knob>_limit)
        self.ceilings = work_ceilings(self.decoding_defaults, self.generation_defaults, self.request_knobs)
        self.total_forwards = 0
        self.total_generated_tokens = 0
        # Wall time of steps that ran a forward. A step ends on its one device->host copy, so the
        # sum is the GPU-bound time of the run even though a step's own span can absorb queued work.
        self.total_step_seconds = 0.0
        # the part of those steps the GPU waits for: up to the forward's launch, after its results
        self.total_host_seconds = 0.0
        self.last_step_host_seconds = 0.0  # the last step's share of it
        self._following = None  # (batch, Launched): the next step's forward, launched ahead by this one
        self.total_launched_ahead = 0  # forwards launched before the last step's postprocess
        self.total_dropped_ahead = 0  # ... of which the next schedule did not run those rows (aborts)

    # --- decoders the model can run ---
    def _missing_special_ids(self, decoder: str) -> list[str]:
        return [name for name in get_decoder(decoder).special_ids if getattr(self.special, name) is None]

    def _decoder_special_ids(self) -> dict[str, int]:
        names = {name for d in DECODERS.values() for name in d.special_ids}
        return {name: getattr(self.special, name) for name in names if getattr(self.special, name) is not None}

    # --- requests ---
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def graph_forwards(self) -> int:
        """Forwards that replayed a CUDA graph (the rest ran eagerly)."""
        return self.runner.num_graph_forwards

    @property
    def kv_free_pages(self) -> int:
        return self.block_manager.num_free_pages

    @property
    def kv_total_pages(self) -> int:
        return self.block_manager.num_pages

    @property
    def kv_cached_pages(self) -> int:
        """Pages holding prefix-cache blocks, in use or not; the unreferenced ones also count in
        kv_free_pages (they are evicted when a request needs the page)."""
        return self.block_manager.num_cached_pages

    @property
    def prefix_cache_queried_blocks(self) -> int:
        """Final leading blocks looked up at admission (every admission, re-admissions too)."""
        return self.block_manager.num_queried_blocks

    @property
    def prefix_cache_hit_blocks(self) -> int:
        return self.block_manager.num_hit_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.block_manager.num_queried_blocks
        return self.block_manager.num_hit_blocks / queried if queried else 0.0

    def check_pages(self) -> None:
        """Raise unless free + cached-unreferenced + in-use pages = total, with honest ref counts."""
        self.block_manager.check(list(self.scheduler.running) + list(self.scheduler.waiting))

    def add_request(self, prompt_ids: list[int], params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Queue a request; bad input raises InvalidRequest and leaves the engine untouched."""
        params = (params or SamplingParams()).resolve(self.decoding_defaults, self.cfg.model.max_new_tokens,
                                                      self.cfg.engine.seed)
        vocab = self.model_config.vocab_size
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            negative = [t for t in prompt_ids if isinstance(t, int) and t < 0]
            if negative:  # (the server's message too: fluxlab/server/protocol.py)
                raise InvalidRequest(f"token ids must be >= 0; got {negative[:5]}", "prompt")
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_new_tokens}) exceeds "
                                 f"max_model_len={self.max_model_len}", "max_tokens")
        missing = self._missing_special_ids(params.decoder)
        if missing:
            raise InvalidRequest(f"decoder={params.decoder} needs the model's {' and '.join(missing)}; "
                                 f"{self.cfg.model.name} has none", "decoder")
        request_id = request_id or next_request_id()
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        request = self._make_request(request_id, prompt_ids, params)
        for name, ceiling in self.ceilings.items():
            problem = above_ceiling(name, getattr(params, name), ceiling)
            if problem:
                raise InvalidRequest(problem, name)
        if not self.block_manager.can_hold(request):
            raise InvalidRequest(f"the request needs {request.num_blocks} KV pages; the cache holds "
                                 f"{self.block_manager.num_pages}", "max_tokens")
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        if self.family.refuses(params.decoder):
            raise InvalidRequest(f"decoder={params.decoder} decodes {owner_of(params.decoder).title} models; "
                                 f"{self.cfg.model.name} is not one", "decoder")
        for name in FAMILY_KNOBS:  # resolve() filled them from the config: a different value is the request's
            if getattr(params, name) != self.decoding_defaults[name]:
                raise InvalidRequest(f"{name} is a {owner_of(name).title} decoder knob; {self.cfg.model.name} "
                                     "does not read it", name)
        request = Request(request_id, prompt_ids, params, self.block_length, self.mask_id, self.eos_ids,
                          self.hidden_ids)
        self._attach_constraint(request)
        return request

    def _attach_constraint(self, request: Request) -> None:
        """The request's matcher, when it has a grammar: made before the request is registered, so a
        grammar llguidance cannot build for this tokenizer is the caller's error; the vocabulary is the
        served tokenizer's, built once."""
        if request.params.grammar is None:
            return
        from fluxlab.engine.constraint import Constraint, GrammarVocab

        try:
            request.constraint = Constraint(GrammarVocab.of(self.tokenizer, request.eos_ids), request.params.grammar)
        except ValueError as err:
            raise InvalidRequest(str(err), "grammar") from None

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self._pending.append(self.scheduler.abort(request))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # --- the loop ---
    # A step that raises fails only the rows that cause it (each row is retried alone). TP turns it
    # off: a half-done collective cannot be retried, so the error is fatal there.
    isolate_failures = True

    def step(self) -> list[RequestOutput]:
        """schedule -> run (forward + decode, one device->host copy) -> postprocess. With async
        scheduling the run is launch -> finish, and finish launches the next step's forward when the
        same rows go again (no block finished), so that forward runs while this postprocess does."""
        outputs, self._pending = self._pending, []
        overdue = self.scheduler.end_overdue()
        for out in overdue:
            self.requests.pop(out.request_id, None)
        outputs += overdue
        if not self.scheduler.has_unfinished():
            self._drop_following()
            return outputs
        started = time.perf_counter()
        batch = self.scheduler.schedule(rows_in_flight=self._following is not None)
        if not batch.requests:  # (batch.rows would build a ScheduledRow per row)
            self._drop_following()
            return outputs
        runner = self.runner
        draws = self._sampler_states(batch)
        try:
            step_output, before = self._run(batch, started)
            results_at = runner.results_at
            # the GPU idles from the results to the next launch: now (launched ahead) or in the next step
            after = runner.launched_at - results_at if self._following is not None else None
            outputs += self.scheduler.postprocess(batch, step_output)
            if after is None:
                after = time.perf_counter() - results_at if step_output is not None else 0.0
            self.total_forwards += 1
            self.last_step_host_seconds = before + after
            self.total_host_seconds += self.last_step_host_seconds
        except EngineFatalError:
            raise
        except Exception as err:  # noqa: BLE001 - one request's bad step must not fail the batch
            self._drop_following()
            if not self.isolate_failures:
                raise
            for request, state in draws:  # every row, not only the failing one: each retry draws as before
                request.restore_sampler_state(state)
            outputs += self._run_rows_alone(batch, err)
        for out in outputs:
            self.total_generated_tokens += len(out.new_token_ids)
            if out.finished:
                self.requests.pop(out.request_id, None)
        self.total_step_seconds += time.perf_counter() - started
        return outputs

    def _sampler_states(self, batch: ScheduledBatch) -> list[tuple[Request, object]]:
        """(request, its draws' state) of the batch's sampling rows before the step: a failed step
        puts every one back before the rows are retried alone, so a seeded request beside a failing
        one draws what it draws alone. (Greedy rows draw nothing; the seats say which rows sample.)"""
        if not batch.seats.full_logits[batch.slots].any():
            return []
        return [(r, r.sampler_state()) for r in batch.requests if r.params.temperature > 0]

    def _run(self, batch: ScheduledBatch, started: float) -> tuple[Optional[StepOutput], float]:
        """The batch's forward and decode step, and the host seconds before its launch (none when the
        last step launched it). Async: the next forward, when finish launched it, is kept in `_following`."""
        runner = self.runner
        if not self.async_scheduling:
            return runner.run(batch), runner.launched_at - started
        following, self._following = self._following, None
        if following is not None and batch.same_rows and batch.slots is following[0].slots \
                and batch.first_block is following[0].first_block:
            launched, before = following[1], 0.0
        else:
            if following is not None:  # its rows changed meanwhile (an abort): that forward is wasted
                self._drop_following(following)
            launched = runner.launch(batch)
            before = runner.launched_at - started
        then = self.scheduler.following(batch)
        step_output, ahead = runner.finish(batch, launched, then)
        if ahead is not None:
            self._following = (then, ahead)
            self.total_launched_ahead += 1
        return step_output, before

    def _drop_following(self, following: Optional[tuple] = None) -> None:
        """Drop the forward launched ahead (`following`, else the one kept in `_following`)."""
        following = following or self._following
        self._following = None
        if following is not None:
            self.runner.settle()
            self.total_dropped_ahead += 1

    @property
    def forward_in_flight(self) -> bool:
        """A forward launched ahead by the last step is still queued (its results come with the next)."""
        return self._following is not None

    def _run_rows_alone(self, batch: ScheduledBatch, err: Exception) -> list[RequestOutput]:
        log.warning("a step of %d rows failed (%s: %s); retrying each row alone", len(batch.rows),
                    type(err).__name__, err)
        self.runner.invalidate_step_state()  # the device state may be half-updated: rewrite it from the host
        outputs = []
        for index, row in enumerate(batch.rows):
            alone = batch.select([index])
            try:
                outputs += self.scheduler.postprocess(alone, self.runner.run(alone))
                self.total_forwards += 1
            except EngineFatalError:
                raise
            except Exception as row_err:  # noqa: BLE001
                log.error("request %s failed: %s: %s", row.request.request_id, type(row_err).__name__, row_err)
                self.runner.invalidate_step_state()
                outputs.append(self.scheduler.fail(row.request, f"{type(row_err).__name__}: {row_err}"))
        return outputs

    def shutdown(self) -> None:
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self._pending = []
        self._drop_following()
        runner = self.runner
        total = runner.num_graph_forwards + runner.num_eager_forwards
        if total:
            log.info("forwards: %d, %d replayed a CUDA graph (%.0f%%), %d eager", total, runner.num_graph_forwards,
                     100 * runner.num_graph_forwards / total, runner.num_eager_forwards)
