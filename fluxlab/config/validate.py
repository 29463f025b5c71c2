"""The one place where cross-field rules are checked and derived values are filled in.

`validate_config` resolves `auto`/null keys (device, attention backend, page size, steps, capture
batch sizes) in place and raises ConfigError naming the keys and values of the first broken rule.
It returns notes (things it changed or dropped) for the caller to log.
"""
from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig, open_dict

from fluxlab.config.schema import AttentionConfig, DecodingConfig
from fluxlab.engine.layers.backends import BACKENDS, FP8_KV_BACKENDS, GRAPH_BACKENDS, KV_CACHE_DTYPES, NO_FP32
from fluxlab.models.registry import FAMILY_KNOBS, UnknownModelFamily, describe, family_of_model, owner_of

POLICIES = ("paged", "dynamic", "static")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending keys."""


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _installed(package: str) -> bool:
    """Whether `package` can be found; imports neither it nor torch."""
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # e.g. a flash_attn package that fails to import
        return False


def _fa4_installed() -> bool:
    return _installed("flash_attn.cute")  # PyPI flash-attn-4


def _flashinfer_installed() -> bool:
    return _installed("flashinfer")


def _triton_installed() -> bool:
    return _installed("triton")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _model_routing_block(model: DictConfig) -> tuple[int, str]:
    """(routing block_size, where it was read) of the configured model; 0 without block routing.

    Read from model.path/config.json when that folder exists, else from model.preset's shapes (a
    JSON read or a dict lookup: no torch). An HF id not on disk falls through to the preset; the
    engine checks the loaded config again (check_block_length) whatever path it took."""
    import json
    from pathlib import Path

    config, source = None, None
    if model.path is not None and (Path(str(model.path)).expanduser() / "config.json").is_file():
        with open(Path(str(model.path)).expanduser() / "config.json") as f:
            config, source = json.load(f), f"block_size in model.path={model.path}/config.json"
    elif model.preset is not None:
        from fluxlab.models.llada2.presets import PRESETS

        config, source = PRESETS.get(model.preset), f"block_size of model.preset={model.preset}"
    if not config or not config.get("expert_capacity"):
        return 0, ""
    return int(config.get("block_size") or 0), source


def _notes_canvas(dec: DictConfig, model: DictConfig, notes: list[str]) -> None:
    """Diffusion-Gemma: the canvas decoder, and a canvas is the block (one page)."""
    _check(dec.decoder == "canvas",
           f"decoding.decoder={dec.decoder}: {describe(model)} is a Diffusion-Gemma model; use decoding=canvas")
    _check(dec.canvas_length >= 1, f"decoding.canvas_length={dec.canvas_length} must be >= 1")
    if dec.block_length != dec.canvas_length:
        notes.append(f"decoding.block_length set to decoding.canvas_length={dec.canvas_length} (a canvas is a block)")
        dec.block_length = dec.canvas_length
    for key, default in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0)):
        _check(dec[key] == default, f"decoding.{key}={dec[key]}: the canvas decoder samples with its own temperature "
                                    "schedule (decoding.t_min, decoding.t_max); leave it at its default")
    if dec.t_min is not None and dec.t_max is not None:
        _check(dec.t_max > dec.t_min, f"decoding.t_max={dec.t_max} must be > decoding.t_min={dec.t_min}")


def _check_ceilings(dec: DictConfig, canvas: bool, name: str) -> None:
    """decoding.<knob>_limit: null, or in its knob's range and not below the default it bounds (a
    Diffusion-Gemma checkpoint's own default is checked when the engine reads it); a limit of the
    other family's knob would bound nothing, so it is refused."""
    from fluxlab.engine.decoding.knobs import KNOBS, LIMIT_KEYS, work_ceilings
    from fluxlab.models.registry import DIFFUSION_GEMMA

    CANVAS_KNOBS = DIFFUSION_GEMMA.knobs

    for knob, key in LIMIT_KEYS.items():
        limit = dec[key]
        if limit is None:
            continue
        _check((knob in CANVAS_KNOBS) == canvas,
               f"decoding.{key}={limit}: {name} does not read {knob} "
               f"({'a canvas-decoder knob (Diffusion-Gemma)' if knob in CANVAS_KNOBS else 'a LLaDA2 decoder knob'}); "
               "leave it null")
        problem = KNOBS[knob].problem(limit, prefix="decoding.")
        _check(problem is None, (problem or "").replace(f"decoding.{knob}=", f"decoding.{key}=", 1))
    try:
        work_ceilings(dec)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_canvas_engine(cfg: DictConfig) -> None:
    """What the Diffusion-Gemma engine (canvas_engine.py) runs: its own paged canvas attention (sdpa, or
    the triton kernel on CUDA), CUDA graphs of its canvas step only (canvas_graphs.py), its experts' own
    kernels, one device."""
    attn, eng, par = cfg.attention, cfg.engine, cfg.parallel
    name = describe(cfg.model)
    if attn.backend == "auto":
        # The kernel (kernels/canvas_attention.py) beat gather + sdpa on an H200 (docs/benchmarks.md, 2026-12-04:
        # 22.2 vs 25.9 ms a step at batch 1). fp32 parity runs keep sdpa, as the block models do.
        half = cfg.engine.dtype in ("bfloat16", "float16")
        attn.backend = "triton" if cfg.engine.device.startswith("cuda") and half and _triton_installed() else "sdpa"
    _check(attn.backend in ("sdpa", "triton"),
           f"attention.backend={attn.backend}: {name} (Diffusion-Gemma) runs its own canvas attention over its two "
           "page pools: sdpa (gathered keys, any device) or triton (fluxlab/kernels/canvas_attention.py, CUDA); "
           "use attention=sdpa or attention=triton")
    _check(not attn.use_prefill_cuda_graph,
           f"attention.use_prefill_cuda_graph=true: {name} (Diffusion-Gemma) graphs only its canvas step "
           "(attention.use_decode_cuda_graph=true: denoising, with or without committing one block); prompt "
           "prefills run eagerly in this build")
    _check(attn.cuda_graph_decode_mode == "padded",
           f"attention.cuda_graph_decode_mode={attn.cuda_graph_decode_mode}: {name} (Diffusion-Gemma) pads a "
           "denoising batch to one graph (padded); a batch larger than the largest graph runs eagerly")
    _check(eng.moe_backend == "auto", f"engine.moe_backend={eng.moe_backend}: {name} (Diffusion-Gemma) picks "
                                      "its experts' kernel itself (grouped GEMM on CUDA bf16); leave it at auto")
    _check(not cfg.scheduler.enable_prefix_cache,
           f"scheduler.enable_prefix_cache=true: {name} (Diffusion-Gemma) keeps only the sliding window's "
           "pages of its sliding layers (fluxlab/models/diffusion_gemma/pages.py), so a cached block's sliding K/V is gone "
           "when its request ends; set scheduler.enable_prefix_cache=false (the model group's default)")
    _check(par.tp_size == 1 and par.ep_size == 1,
           f"parallel.tp_size={par.tp_size}, parallel.ep_size={par.ep_size}: {name} (Diffusion-Gemma) runs on "
           "one device in this build (parallel.dp_size replicas work)")


def validate_config(cfg: DictConfig, cuda_available: Optional[bool] = None) -> list[str]:
    """Resolve derived keys of a run config in place and check every cross-field rule."""
    notes: list[str] = []
    if cuda_available is None:
        cuda_available = _cuda_available()
    eng, model, sched, attn, dec, par = (
        cfg.engine, cfg.model, cfg.scheduler, cfg.attention, cfg.decoding, cfg.parallel)

    with open_dict(cfg):
        # --- engine ---
        if eng.device == "auto":
            eng.device = "cuda" if cuda_available else "cpu"
        _check(eng.device == "cpu" or eng.device.startswith("cuda"),
               f"engine.device={eng.device!r}: use auto, cpu, cuda or cuda:N")
        on_cuda = eng.device.startswith("cuda")
        _check(not on_cuda or cuda_available,
               f"engine.device={eng.device!r} but no CUDA device is visible; use engine.device=cpu")
        _check(eng.dtype in DTYPES, f"engine.dtype={eng.dtype!r}: use one of {', '.join(DTYPES)}")
        _check(0.0 < eng.gpu_memory_utilization <= 1.0,
               f"engine.gpu_memory_utilization={eng.gpu_memory_utilization} must be in (0, 1]")
        _check(0.0 <= eng.gpu_memory_safety_reserve < eng.gpu_memory_utilization,
               f"engine.gpu_memory_safety_reserve={eng.gpu_memory_safety_reserve} must be in "
               f"[0, engine.gpu_memory_utilization={eng.gpu_memory_utilization})")
        _check(eng.kv_cache_layout in ("paged", "dense"),
               f"engine.kv_cache_layout={eng.kv_cache_layout!r}: use paged or dense")
        _check(eng.moe_backend in ("auto", "grouped_mm", "triton", "torch", "loop"),
               f"engine.moe_backend={eng.moe_backend!r}: use auto, grouped_mm, triton, torch or loop")
        _check(eng.cpu_kv_cache_gb > 0, f"engine.cpu_kv_cache_gb={eng.cpu_kv_cache_gb} must be > 0")

        # --- decoding ---
        # Names and ranges are the decoder registry's (imported here: `--help` must not load torch).
        from fluxlab.engine.decoding.registry import DECODERS, KNOBS

        _check(dec.decoder in DECODERS,
               f"decoding.decoder={dec.decoder!r}: use one of {', '.join(DECODERS)}")
        try:
            family = family_of_model(model)
        except UnknownModelFamily as err:
            raise ConfigError(str(err)) from None
        if family.canvas:
            _notes_canvas(dec, model, notes)
        else:
            if family.refuses(dec.decoder):
                raise ConfigError(f"decoding.decoder={dec.decoder} decodes {owner_of(dec.decoder).title} models only; "
                                  f"{describe(model)} is not one")
            # Canvases are Diffusion-Gemma's blocks: on any other model the key would be ignored.
            _check(dec.canvas_length == DecodingConfig.canvas_length,
                   f"decoding.canvas_length={dec.canvas_length}: only Diffusion-Gemma models decode canvases; "
                   f"{describe(model)} decodes blocks of decoding.block_length")
            # Knobs another family's own decoder reads (max_denoising_steps is also the block decoders' steps, below).
            for key in (k for k in FAMILY_KNOBS if k not in family.knobs and k != "max_denoising_steps"):
                if dec[key] is not None:
                    raise ConfigError(f"decoding.{key}={dec[key]} is a {owner_of(key).title} decoder knob; "
                                      f"{describe(model)} does not read it")
            if dec.max_denoising_steps is not None:
                dec.steps = dec.max_denoising_steps
                notes.append(f"decoding.steps set to decoding.max_denoising_steps={dec.max_denoising_steps}")
        bl = dec.block_length
        _check(bl >= 1, f"decoding.block_length={bl} must be >= 1")
        if dec.steps is None:
            dec.steps = bl
        for knob in KNOBS.values():
            problem = knob.problem(dec[knob.name], bl, prefix="decoding.")
            _check(problem is None, problem)
        _check_ceilings(dec, family.canvas, describe(model))
        _check(not DECODERS[dec.decoder].greedy_only or dec.temperature == 0,
               f"decoding.temperature={dec.temperature} must be 0 for decoding.decoder={dec.decoder} (greedy only)")

        # --- model ---
        _check(model.load_format in ("auto", "random"),
               f"model.load_format={model.load_format!r}: use auto or random")
        _check(model.load_format != "random" or model.preset is not None,
               "model.load_format=random needs model.preset (the shapes to build)")
        _check(model.quantization in ("none", "fp8"), f"model.quantization={model.quantization!r}: use none or fp8")
        if model.quantization == "fp8":
            _check(family.fp8_weights,
                   f"model.quantization=fp8: {describe(model)} ({family.title}) has no FP8 weight path yet (LLaDA2 and "
                   "Diffusion-Gemma have); use model.quantization=none")
            _check(par.tp_size == 1 and par.ep_size == 1,
                   f"model.quantization=fp8 with parallel.tp_size={par.tp_size}, parallel.ep_size={par.ep_size}: FP8 "
                   "runs on one GPU (the 128x128 block scales are not cut into TP/EP shards yet)")
            _check(eng.moe_backend in ("auto", "triton"),
                   f"engine.moe_backend={eng.moe_backend} with model.quantization=fp8: the FP8 experts run the FP8 "
                   "Triton kernel on a GPU and its dequantize reference on CPU; use auto")
        _check(model.kv_cache_dtype in KV_CACHE_DTYPES,
               f"model.kv_cache_dtype={model.kv_cache_dtype!r}: use {' or '.join(KV_CACHE_DTYPES)}")
        _check(model.kv_cache_dtype == "auto" or not family.canvas,
               f"model.kv_cache_dtype={model.kv_cache_dtype}: {describe(model)} (Diffusion-Gemma) keeps its canvas "
               "pages (fluxlab/models/diffusion_gemma/pages.py) in the model dtype; use model.kv_cache_dtype=auto")
        _check(model.max_model_len >= bl,
               f"model.max_model_len={model.max_model_len} must be >= decoding.block_length={bl}")
        _check(1 <= model.max_new_tokens < model.max_model_len,
               f"model.max_new_tokens={model.max_new_tokens} must be in [1, model.max_model_len={model.max_model_len})")
        routing_block, source = _model_routing_block(model)
        _check(not routing_block or bl % routing_block == 0,
               f"decoding.block_length={bl} must be a multiple of the model's routing block_size={routing_block} "
               f"({source}): LLaDA2.2 block routing needs whole routing blocks of one request per row")

        # --- scheduler and KV layout ---
        _check(sched.policy in POLICIES, f"scheduler.policy={sched.policy!r}: use one of {', '.join(POLICIES)}")
        _check(sched.max_num_seqs >= 1, f"scheduler.max_num_seqs={sched.max_num_seqs} must be >= 1")
        if sched.policy in ("paged", "dynamic"):
            _check(eng.kv_cache_layout == "paged",
                   f"scheduler.policy={sched.policy} needs engine.kv_cache_layout=paged "
                   f"(got {eng.kv_cache_layout}); the dense layout runs with scheduler=static")
        _check(not sched.enable_prefix_cache or eng.kv_cache_layout == "paged",
               f"scheduler.enable_prefix_cache=true needs engine.kv_cache_layout=paged (got "
               f"{eng.kv_cache_layout}): requests share cached pages, a dense slot is one request's; "
               "set scheduler.enable_prefix_cache=false with the dense layout")
        if eng.page_size is None:
            eng.page_size = bl
        if sched.policy in ("paged", "dynamic"):
            _check(eng.page_size == bl,
                   f"engine.page_size={eng.page_size} must equal decoding.block_length={bl} "
                   f"under scheduler.policy={sched.policy} (one block is one page)")
            _check(model.max_model_len % bl == 0,
                   f"model.max_model_len={model.max_model_len} must be divisible by "
                   f"decoding.block_length={bl} under scheduler.policy={sched.policy}")
            _check(sched.max_scheduled_tokens % bl == 0,
                   f"scheduler.max_scheduled_tokens={sched.max_scheduled_tokens} must be divisible by "
                   f"decoding.block_length={bl} under scheduler.policy={sched.policy}")
        else:
            _check(eng.page_size == bl,
                   f"engine.page_size={eng.page_size} must equal decoding.block_length={bl}")
            _check(model.max_model_len % bl == 0,
                   f"model.max_model_len={model.max_model_len} must be divisible by decoding.block_length={bl}")
        _check(sched.max_scheduled_tokens >= bl,
               f"scheduler.max_scheduled_tokens={sched.max_scheduled_tokens} must be >= decoding.block_length={bl}")

        # --- attention ---
        if family.canvas:
            _check_canvas_engine(cfg)
        if attn.backend == "auto":
            # FlashInfer has no fp32 kernels: exact-parity (float32) runs on CUDA use sdpa. Without
            # the [gpu] extra, fluxlab's own Triton kernel (triton comes with CUDA builds of torch).
            attn.backend = "sdpa"
            if on_cuda and eng.dtype != "float32":
                if model.kv_cache_dtype != "auto" and _triton_installed():
                    attn.backend = "triton"  # the GPU backend that reads FP8 pages
                elif _flashinfer_installed():
                    attn.backend = "flashinfer"
                elif _triton_installed():
                    attn.backend = "triton"
                    notes.append("attention=auto: flashinfer is not installed (pip install flashinfer-python, or "
                                 "the [gpu] extra); using attention=triton")
        _check(attn.backend in BACKENDS, f"attention.backend={attn.backend!r}: use one of auto, {', '.join(BACKENDS)}")
        _check(model.kv_cache_dtype == "auto" or attn.backend in FP8_KV_BACKENDS,
               f"model.kv_cache_dtype={model.kv_cache_dtype} with attention.backend={attn.backend}: only "
               f"{' and '.join(FP8_KV_BACKENDS)} read FP8 KV pages (fluxlab/engine/layers/kv_fp8.py; the FP8 paths of "
               "FlashInfer and FA4 are not wired in); use attention=triton or attention=sdpa")
        _check(on_cuda or attn.backend == "sdpa",
               f"attention.backend={attn.backend} needs a CUDA device but engine.device={eng.device}; "
               "use attention=sdpa on CPU")
        _check(attn.backend not in NO_FP32 or eng.dtype != "float32",
               f"attention.backend={attn.backend} has no float32 kernels (engine.dtype=float32); use attention=sdpa "
               "or engine.dtype=bfloat16")
        _check(attn.backend != "flashinfer" or _flashinfer_installed(),
               "attention.backend=flashinfer needs the flashinfer package (pip install flashinfer-python==0.6.13, or "
               "the [gpu] extra); use attention=triton or attention=sdpa")
        _check(attn.backend != "fa4" or _fa4_installed(),
               "attention.backend=fa4 needs flash_attn.cute (pip install flash-attn-4==4.0.0b36, or the [gpu] extra); "
               "use attention=flashinfer or attention=sdpa")
        _check(attn.backend != "triton" or _triton_installed(),
               "attention.backend=triton needs the triton package (it comes with CUDA builds of torch); "
               "use attention=flashinfer or attention=sdpa")
        _check(attn.cuda_graph_decode_mode in ("padded", "decomposed"),
               f"attention.cuda_graph_decode_mode={attn.cuda_graph_decode_mode!r}: use padded or decomposed")
        # the reference system's --use-cuda-graph: an alias of use_decode_cuda_graph, named in the messages
        graph_keys = "attention.use_decode_cuda_graph/use_prefill_cuda_graph"
        if attn.use_cuda_graph:
            attn.use_decode_cuda_graph = True
            graph_keys = "attention.use_cuda_graph (= use_decode_cuda_graph)"
        graphs = attn.use_decode_cuda_graph or attn.use_prefill_cuda_graph
        _check(not graphs or on_cuda, f"{graph_keys} need a CUDA device (engine.device={eng.device})")
        _check(not graphs or attn.backend in GRAPH_BACKENDS or family.canvas,
               f"{graph_keys} need attention.backend={', '.join(GRAPH_BACKENDS)} (got {attn.backend})")
        # Graph-size keys are read only by the graphs they size: set without those graphs, refuse.
        # (Derived values are filled in only where read, so a resolved config validates again.)
        _check(attn.cuda_graph_capture_bs is None or attn.use_decode_cuda_graph,
               f"attention.cuda_graph_capture_bs={list(attn.cuda_graph_capture_bs or [])} sizes decode graphs, "
               "which are off: set attention.use_decode_cuda_graph=true or drop the key")
        _check(list(attn.cuda_graph_capture_sizes) == AttentionConfig().cuda_graph_capture_sizes
               or attn.use_prefill_cuda_graph,
               f"attention.cuda_graph_capture_sizes={list(attn.cuda_graph_capture_sizes)} sizes prefill graphs, "
               "which are off: set attention.use_prefill_cuda_graph=true or drop the key")
        _check(graphs or attn.cuda_graph_decode_mode == AttentionConfig.cuda_graph_decode_mode,
               f"attention.cuda_graph_decode_mode={attn.cuda_graph_decode_mode} chooses how batches replay CUDA "
               "graphs, which are off: set attention.use_decode_cuda_graph=true or drop the key")
        if attn.use_decode_cuda_graph:
            if attn.cuda_graph_capture_bs is None:
                sizes, b = [], 1
                while b < sched.max_num_seqs:
                    sizes.append(b)
                    b *= 2
                attn.cuda_graph_capture_bs = sizes + [sched.max_num_seqs]
            capture_bs = list(attn.cuda_graph_capture_bs)
            _check(all(1 <= b <= sched.max_num_seqs for b in capture_bs),
                   f"attention.cuda_graph_capture_bs={capture_bs}: each must be in [1, scheduler.max_num_seqs="
                   f"{sched.max_num_seqs}]")
            attn.cuda_graph_capture_bs = sorted(set(capture_bs))
        if attn.use_prefill_cuda_graph:
            sizes = list(attn.cuda_graph_capture_sizes)
            kept = sorted({s for s in sizes if s > 0 and s % bl == 0 and s <= model.max_model_len})
            dropped = [s for s in sizes if s not in kept]
            if dropped:
                notes.append(f"attention.cuda_graph_capture_sizes: dropped {dropped} (need positive, multiples of "
                             f"decoding.block_length={bl}, <= model.max_model_len={model.max_model_len}); kept {kept}")
            attn.cuda_graph_capture_sizes = kept

        # --- parallel (DESIGN §7) ---
        for key in ("tp_size", "ep_size", "dp_size"):
            _check(par[key] >= 1, f"parallel.{key}={par[key]} must be a positive integer")
        _check(par.ep_size in (1, par.tp_size),
               f"parallel.ep_size={par.ep_size} with parallel.tp_size={par.tp_size}: supported are "
               "ep_size == tp_size (experts split across the TP ranks) or ep_size=1 (experts split on their width)")
        if par.enable_dp_attention:
            # One engine of tp_size ranks: attention data parallel over dp_size = tp_size ranks (each its
            # own requests and KV), routed experts split over all of them; parallel.dp_size counts those
            # ranks here, not router replicas.
            _check(par.tp_size > 1 and par.dp_size == par.tp_size and par.ep_size == par.tp_size,
                   f"parallel.enable_dp_attention=true needs parallel.dp_size == parallel.ep_size == parallel.tp_size "
                   f"> 1 (attention whole on each of the tp_size ranks, experts over all of them); got tp_size="
                   f"{par.tp_size}, dp_size={par.dp_size}, ep_size={par.ep_size}")
            _check(not graphs, "parallel.enable_dp_attention=true runs eagerly: each rank's token count changes every "
                               "step; set attention.use_decode_cuda_graph=false and attention.use_prefill_cuda_graph=false")
        # Async scheduling launches a forward from rank 0's results alone, and the canvas runner has no launch step.
        async_ok = par.tp_size == 1 and not family.canvas
        _check(sched.async_scheduling is not True or async_ok,
               f"scheduler.async_scheduling=true runs on one-GPU LLaDA2 engines only (got parallel.tp_size={par.tp_size}, "
               f"{describe(model)}); leave it null or set it false")
        if sched.async_scheduling is None:
            sched.async_scheduling = async_ok
        _check(par.distributed_backend in ("nccl", "gloo"),
               f"parallel.distributed_backend={par.distributed_backend!r}: use nccl or gloo")
        if not on_cuda and par.distributed_backend == "nccl" and par.tp_size > 1:
            par.distributed_backend = "gloo"
            notes.append("parallel.distributed_backend: nccl needs CUDA, using gloo on CPU")

        # --- server ---
        _check(0 <= cfg.server.port <= 65535, f"server.port={cfg.server.port} must be in [0, 65535]")
        _check(cfg.server.max_waiting_requests >= 1,
               f"server.max_waiting_requests={cfg.server.max_waiting_requests} must be >= 1")
        if cfg.server.served_model_name is None:
            cfg.server.served_model_name = model.name
    return notes
