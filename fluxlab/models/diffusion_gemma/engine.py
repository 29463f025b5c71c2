"""The engine for Diffusion-Gemma: LLMEngine's loop and scheduler, canvas requests and runner.

A canvas is a block (page size = canvas length, decoding.block_length = decoding.canvas_length),
so `LLMEngine.step()`, the paged/dynamic/static policies and preemption run unchanged; what
differs is the KV pages (canvas_pages.py: sliding layers keep a ring of their window's pages, so
no prefix cache), is the request geometry (canvas_request.py), the model and its runner
(canvas_runner.py) and the per-request canvas knobs, whose unset values are the checkpoint's
generation_config.json. attention.use_decode_cuda_graph=true replays CUDA graphs of the canvas
step (canvas_graphs.py) for batches whose rows denoise their canvas, alone or right after committing
one block, padded to attention.cuda_graph_capture_bs and the ROW_LADDER_STEP ladder; prefills of
several blocks and commits without a canvas run eagerly.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from fluxlab.models.diffusion_gemma.paged_attention import CanvasKVCache
from fluxlab.models.diffusion_gemma.graphs import denoise_row_sizes
from fluxlab.models.diffusion_gemma.pages import CanvasBlockManager, sliding_ring_size
from fluxlab.models.diffusion_gemma.request import CanvasRequest
from fluxlab.models.diffusion_gemma.runner import CanvasRunner, kv_shapes
from fluxlab.models.diffusion_gemma.decoding import CANVAS_KNOBS, CanvasKnobs, read_generation_defaults
from fluxlab.engine.llm_engine import LLMEngine
from fluxlab.engine.loading import load_tokenizer
from fluxlab.engine.request import InvalidRequest, SamplingParams
from fluxlab.engine.batch import ScheduledBatch
from fluxlab.engine.scheduler import Scheduler
from fluxlab.engine.stop import StopStrings

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("fluxlab.engine")


def canvas_model_dir(model_cfg) -> Optional[Path]:
    from fluxlab.checkpoint import ensure_tiny_checkpoint
    from fluxlab.models.diffusion_gemma.checkpoint import PRESET

    if model_cfg.path is not None and Path(str(model_cfg.path)).expanduser().is_dir():
        return Path(str(model_cfg.path)).expanduser()
    if model_cfg.path is None and model_cfg.preset == PRESET:
        return ensure_tiny_checkpoint(preset=PRESET)
    if model_cfg.load_format == "random":
        return None
    raise ValueError(f"model.path={model_cfg.path!r} is not a local directory. fluxlab does not download weights: "
                     "set model.path=DIR, or model.load_format=random for speed work")


def eos_ids_of(model_dir: Optional[Path], text_config) -> tuple[int, ...]:
    """generate()'s EOS ids: generation_config.json's eos_token_id, else the text config's."""
    eos = None
    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        import json

        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    if eos is None:
        eos = text_config.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))


def _warn_on_canvas_mismatch(model_dir: Optional[Path], canvas_length: int) -> None:
    """transformers' generate() denoises canvases of config.json's canvas_length; another
    decoding.canvas_length is a valid knob but gives other tokens than the checkpoint's generate()
    (a model group's canvas_length stays when model.path names another checkpoint)."""
    import json

    if model_dir is None or not (model_dir / "config.json").is_file():
        return
    own = json.loads((model_dir / "config.json").read_text()).get("canvas_length")
    if own is not None and int(own) != canvas_length:
        log.warning("decoding.canvas_length=%d but %s/config.json has canvas_length=%d: tokens will differ from "
                    "transformers' generate() on this checkpoint; set decoding.canvas_length=%d for parity",
                    canvas_length, model_dir, own, own)


class CanvasEngine(LLMEngine):
    request_knobs = CANVAS_KNOBS
    def __init__(self, cfg: DictConfig):  # noqa: D107 - mirrors LLMEngine.__init__ for this model
        from fluxlab.models.diffusion_gemma.loader import load_model

        self._init_device(cfg)
        if cfg.parallel.tp_size > 1:
            raise ValueError("parallel.tp_size > 1: Diffusion-Gemma runs on one device in this build")
        model_dir = canvas_model_dir(cfg.model)
        self.tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
        self.model = load_model(cfg.model, model_dir, self.dtype, self.device, cfg.engine.seed)  # model.quantization too
        self.model_config = self.model.config
        self.generation_defaults = read_generation_defaults(model_dir)
        self.eos_ids = eos_ids_of(model_dir, self.model_config)
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self.mask_id, self.hidden_ids, self.special = None, (), None
        self.block_length = cfg.decoding.canvas_length  # validation made decoding.block_length the same
        _warn_on_canvas_mismatch(model_dir, self.block_length)
        self.max_model_len = cfg.model.max_model_len
        self.kv_shapes = kv_shapes(self.model_config)
        # a prompt's left padding (canvas_request.py) can take one page more than max_model_len / L
        pages_per_seq = self.max_model_len // self.block_length + 1
        max_pages_useful = cfg.scheduler.max_num_seqs * pages_per_seq
        # sliding layers: a fixed ring per seat, taken from the budget before the full-layer pages
        self.ring_size = min(sliding_ring_size(self.model.sliding_window, self.block_length), pages_per_seq)
        sliding_bytes = cfg.scheduler.max_num_seqs * self.ring_size * self._page_bytes(sliding=True)
        if cfg.scheduler.num_device_pages > 0:
            num_pages = cfg.scheduler.num_device_pages
        elif self.device.type == "cuda":
            num_pages = min(self._profile_canvas_pages(sliding_bytes), max_pages_useful)
        else:
            budget = int(cfg.engine.cpu_kv_cache_gb * 2**30) - sliding_bytes
            num_pages = min(max(budget, 0) // self._page_bytes(sliding=False), max_pages_useful)
        self.block_manager = CanvasBlockManager(num_pages, cfg.engine.kv_cache_layout, pages_per_seq,
                                                cfg.scheduler.max_num_seqs, pages_per_seq, self.ring_size,
                                                enable_prefix_cache=cfg.scheduler.enable_prefix_cache)
        self.scheduler = Scheduler(cfg.scheduler.policy, cfg.scheduler.max_num_seqs,
                                   cfg.scheduler.max_scheduled_tokens, self.block_length, self.block_manager,
                                   StopStrings(self.tokenizer), decode_writes_kv=False,
                                   request_timeout_s=cfg.server.request_timeout_s)
        self.runner = CanvasRunner(self.model, self.block_manager.num_pages, self.block_manager.num_sliding_pages,
                                   self.ring_size, self.block_length, self.device, self.dtype, pages_per_seq,
                                   cfg.attention.backend)
        if cfg.attention.use_decode_cuda_graph:  # validation: on CUDA, capture sizes resolved
            self.runner.enable_denoise_graphs(denoise_row_sizes(list(cfg.attention.cuda_graph_capture_bs)),
                                              capture=True)
        self._init_requests()
        self.async_scheduling = False  # the canvas runner has no separate launch
        log.info("engine ready: %s on %s (%s), %d full-layer KV pages of one %d-token canvas, %d sliding-layer "
                 "pages (%d a request), policy=%s", cfg.model.name, self.device, cfg.engine.dtype,
                 self.block_manager.num_pages, self.block_length, self.block_manager.num_sliding_pages,
                 self.ring_size, cfg.scheduler.policy)

    def _page_bytes(self, sliding: bool) -> int:
        return CanvasKVCache.bytes_per_page(self.kv_shapes, self.model.layer_is_sliding, sliding, self.block_length,
                                            self.dtype)

    def _profile_canvas_pages(self, sliding_bytes: int) -> int:
        """Pages in (gpu_memory_utilization - safety reserve) of the card after the weights and a
        canvas step at max_num_seqs rows (its logits dominate: rows x canvas x vocab in fp32)."""
        from fluxlab.engine.batch import ScheduledRow

        eng, L = self.cfg.engine, self.block_length
        rows = self.cfg.scheduler.max_num_seqs
        probe = CanvasRunner(self.model, 2 * rows, 2 * rows, self.ring_size, L, self.device, self.dtype, 2,
                             self.cfg.attention.backend)
        knobs = CanvasKnobs(**self.generation_defaults)
        fake = []
        for r in range(rows):
            request = CanvasRequest(f"probe-{r}", [0] * L, SamplingParams(max_new_tokens=L, seed=0), L, (), knobs)
            request.params = SamplingParams(max_new_tokens=L, seed=0)
            request.page_table = [2 * r, 2 * r + 1]
            request.sliding_pages = [2 * r, 2 * r + 1]
            fake.append(ScheduledRow(request, 0, 2, True))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        probe.run(ScheduledBatch.of_rows(fake, L))
        torch.cuda.synchronize(self.device)
        probe_kv = sum(t.nbytes for t in probe.cache.k + probe.cache.v)
        peak = torch.cuda.max_memory_allocated(self.device) - probe_kv
        del probe, fake
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        budget = total * (eng.gpu_memory_utilization - eng.gpu_memory_safety_reserve) - peak - sliding_bytes
        if self.cfg.attention.use_decode_cuda_graph:  # the graphs' pool holds a step's activations again
            weights = sum(t.nbytes for t in list(self.model.parameters()) + list(self.model.buffers()))
            budget -= peak - weights
        pages = int(budget // self._page_bytes(sliding=False))
        if pages < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache: weights + a canvas step take {peak / 2**30:.1f} "
                               "GiB; raise engine.gpu_memory_utilization or lower scheduler.max_num_seqs")
        log.info("KV profile: peak %.2f GiB with weights, budget %.2f GiB -> %d pages", peak / 2**30,
                 budget / 2**30, pages)
        return pages

    def _sampler_states(self, batch: ScheduledBatch) -> list[tuple[CanvasRequest, object]]:
        """Every denoising row draws (its multinomial, its renoise canvas): their canvas states."""
        return [(r, r.sampler_state()) for r in batch.decode_requests]

    def _make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> CanvasRequest:
        if params.decoder != "canvas":
            raise InvalidRequest(f"decoder={params.decoder}: {self.cfg.model.name} is a Diffusion-Gemma model and "
                                 "decodes with decoder=canvas", "decoder")
        for name, default in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0)):
            if getattr(params, name) != default:
                raise InvalidRequest(f"{name}={getattr(params, name)}: the canvas decoder samples with its own "
                                     "temperature schedule (t_min, t_max); leave it unset", name)
        values = {k: getattr(params, k) if getattr(params, k) is not None else self.generation_defaults[k]
                  for k in CANVAS_KNOBS}
        if not values["t_max"] > values["t_min"]:
            raise InvalidRequest(f"t_max={values['t_max']} must be > t_min={values['t_min']} (transformers' rule)",
                                 "t_max")
        request = CanvasRequest(request_id, prompt_ids, params, self.block_length, self.eos_ids, CanvasKnobs(**values))
        self._attach_constraint(request)  # a grammar: the canvas rule (constrained.py)
        return request
