"""Structured-config schema: one dataclass per config group, registered with Hydra's ConfigStore.

Every YAML under conf/ is merged onto these, so a misspelt key or a wrong type fails at compose
time, before anything heavy loads. Defaults follow the reference system's `launch` flags (DESIGN §3).
Each key is declared with `key(default, "one line")`: that line is what `python -m fluxlab <command>
--help` prints beside the key, so a key is described here and nowhere else.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional

from hydra.core.config_store import ConfigStore


def key(default: Any, help: str) -> Any:
    """A config key: its default (a value, a list, or a section's dataclass) and its one-line help."""
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata={"help": help})
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    device: str = key("auto", "auto = cuda when a GPU is present, else cpu")
    dtype: str = key("bfloat16", "weights and activations: bfloat16 | float16 | float32 (float32 for exact-parity runs)")
    seed: int = key(0, "torch seed at start (random weights, sampling without a per-request seed)")
    gpu_memory_utilization: float = key(0.90, "share of the GPU's memory the engine may fill (weights + KV pages)")
    gpu_memory_safety_reserve: float = key(0.05, "share of the GPU's memory kept free below gpu_memory_utilization")
    kv_cache_layout: str = key("paged", "paged | dense (dense needs scheduler=static)")
    page_size: Optional[int] = key(None, "KV page size in tokens; null -> decoding.block_length")
    cpu_kv_cache_gb: float = key(1.0, "KV budget when the engine runs on CPU (no memory profiling there)")
    moe_backend: str = key("auto", "CUDA: auto | grouped_mm (torch._grouped_mm) | triton (fluxlab/kernels); torch = loop")


@dataclass
class ModelConfig:
    name: str = key("tiny_llada2", "model name: the API's model field (server.served_model_name overrides)")
    path: Optional[str] = key(None, "local checkpoint folder or HF id (fluxlab never downloads); null = the preset's tiny checkpoint (tiny_*) or random weights")
    load_format: str = key("auto", "auto (safetensors from path) | random (random weights of `preset`, built on device)")
    preset: Optional[str] = key(None, "shapes for load_format=random: tiny, llada2_mini, llada2_flash, ...")
    max_model_len: int = key(2048, "longest prompt + output in tokens (a multiple of decoding.block_length)")
    max_new_tokens: int = key(128, "output tokens when a request does not say (and their cap)")
    trust_remote_code: bool = key(True, "let the tokenizer run the code in the checkpoint folder")
    quantization: str = key("none", "none | fp8: e4m3 weights with 128x128 block scales (weight_scale_inv) for the projections and "
                                    "routed experts, activations per 128-wide token group; router, norms, embeddings and lm_head "
                                    "unquantized (Diffusion-Gemma: its self-conditioning MLP too). LLaDA2 and Diffusion-Gemma on one GPU or CPU; "
                                    "quantizes bf16 weights at load or reads an FP8 checkpoint")
    kv_cache_dtype: str = key("auto", "KV pages: auto (the model dtype) | fp8_e4m3 (half the bytes, twice the pages; per-layer "
                                      "scales 1.0, static; attention sdpa or triton; LLaDA2 and SDAR)")


@dataclass
class SchedulerConfig:
    policy: str = key("paged", "paged (step-synchronous) | dynamic (mixed prefill + decode) | static (cohorts)")
    max_num_seqs: int = key(8, "requests running at once (seats)")
    max_scheduled_tokens: int = key(512, "tokens one forward may hold (a multiple of decoding.block_length)")
    num_device_pages: int = key(0, "KV pages; <= 0: profile from free memory (GPU) or engine.cpu_kv_cache_gb (CPU)")
    enable_prefix_cache: bool = key(True, "reuse committed blocks' K/V across requests (paged KV layout)")
    # vLLM's async scheduling: launch the next forward of the same rows before postprocess when no block finished.
    async_scheduling: Optional[bool] = key(None, "launch the next forward before postprocess (vLLM's async scheduling); "
                                                 "null = on for one-GPU LLaDA2 engines, off under TP and Diffusion-Gemma")


@dataclass
class AttentionConfig:
    backend: str = key("auto", "auto = flashinfer on CUDA (triton without it or with an FP8 KV cache), sdpa on CPU and "
                                      "fp32; sdpa | flashinfer | fa4 | triton")
    use_cuda_graph: bool = key(False, "the reference system's --use-cuda-graph: turns on decode graphs")
    use_prefill_cuda_graph: bool = key(False, "CUDA graphs for prefill / mixed forwards up to cuda_graph_capture_sizes tokens")
    use_decode_cuda_graph: bool = key(False, "CUDA graphs for decode batches up to cuda_graph_capture_bs rows")
    cuda_graph_decode_mode: str = key("padded", "padded (one graph, the smallest size that holds the batch) | decomposed (chunks)")
    cuda_graph_capture_bs: Optional[List[int]] = key(None, "decode graph batch sizes; null -> [1, 2, 4, ..., scheduler.max_num_seqs]")
    cuda_graph_capture_sizes: List[int] = key([64, 128, 256, 512, 1024], "prefill graph sizes in tokens")


@dataclass
class DecodingConfig:
    decoder: str = key("threshold", "threshold | hierarchy | joint_threshold | levenshtein_joint | canvas")
    block_length: int = key(64, "tokens per block: the unit decoded in parallel, committed, cached")
    canvas_length: int = key(128, "Diffusion-Gemma: tokens per canvas")
    max_denoising_steps: Optional[int] = key(None, "LLaDA2: overrides steps (smoke tests); canvas: steps per canvas")
    entropy_bound: Optional[float] = key(None, "canvas: entropy bound of the sampler; null = the checkpoint's generation_config.json")
    t_min: Optional[float] = key(None, "canvas: lowest noise level; null = the checkpoint's generation_config.json")
    t_max: Optional[float] = key(None, "canvas: highest noise level; null = the checkpoint's generation_config.json")
    stability_threshold: Optional[int] = key(None, "canvas: steps a token must stay unchanged; null = the checkpoint's")
    confidence_threshold: Optional[float] = key(None, "canvas: confidence to keep a token; null = the checkpoint's")
    steps: Optional[int] = key(None, "transfer schedule per block; null -> block_length")
    threshold: float = key(0.9, "commit a masked token once its probability reaches this (0..1)")
    low_threshold: float = key(0.3, "hierarchy: the lower threshold (0..1)")
    editing_threshold: float = key(0.5, "joint_threshold: rewrite a committed token above this; 0.0 = whenever the argmax differs")
    max_post_steps: int = key(16, "joint_threshold, levenshtein_joint: editing forwards after a block is filled")
    max_steps_per_block: int = key(1000, "levenshtein_joint: hard cap on forwards per block (>= 2)")
    # Ceilings of the per-request knobs that multiply work (decoding/knobs.py LIMIT_KEYS): above one, a 400
    max_post_steps_limit: Optional[int] = key(None, "most max_post_steps a request may ask for; null = decoding.max_post_steps")
    max_steps_per_block_limit: Optional[int] = key(None, "most max_steps_per_block a request may ask for; null = decoding.max_steps_per_block")
    max_denoising_steps_limit: Optional[int] = key(None, "canvas: most max_denoising_steps a request may ask for; null = decoding.max_denoising_steps, else the checkpoint's")
    temperature: float = key(0.0, "sampling temperature; 0 = argmax")
    top_p: float = key(1.0, "nucleus sampling mass; 1.0 = off")
    top_k: int = key(0, "sample from the k likeliest tokens; 0 = off")


@dataclass
class ParallelConfig:
    tp_size: int = key(1, "tensor-parallel GPUs")
    dp_size: int = key(1, "data-parallel replicas (behind sglang-router, or attention ranks with enable_dp_attention)")
    ep_size: int = key(1, "expert-parallel GPUs for the MoE layers")
    enable_dp_attention: bool = key(False, "data-parallel attention, expert-parallel MoE, one endpoint")
    distributed_backend: str = key("nccl", "torch.distributed backend; gloo is used on CPU")
    startup_timeout_s: float = key(600.0, "seconds the workers may take to start")


@dataclass
class ServerConfig:
    host: str = key("0.0.0.0", "address the HTTP server listens on")
    port: int = key(8000, "HTTP port; 0 = any free port")
    api_key: Optional[str] = key(None, "Bearer token every path but /health asks for; null = no auth")
    served_model_name: Optional[str] = key(None, "model name in the API; null -> model.name")
    max_waiting_requests: int = key(1024, "queued requests past which the server answers 503")
    log_level: str = key("info", "uvicorn log level: debug | info | warning | error")
    worker_urls: List[str] = key([], "dp: extra replicas on other hosts")
    router_policy: str = key("cache_aware", "sglang-router policy for dp replicas")
    health_timeout_s: float = key(600.0, "seconds a dp replica may take to become healthy")
    max_request_body_bytes: int = key(8 * 1024 * 1024, "larger bodies are a 413 before parsing; <= 0: no limit")
    request_timeout_s: float = key(600.0, "seconds a request may hold a seat (from its first admission): then it ends with the tokens it has (finish_reason length) and frees its seat; <= 0: none")
    drain_timeout_s: float = key(0.0, "on SIGTERM: seconds in-flight requests may finish (new ones get 503), then they are aborted")
    client_read_timeout_s: float = key(30.0, "seconds a client may take to send a request's headers, and between body chunks; <= 0: none")
    parse_special_tokens_in_chat: bool = key(False, "true: special-token text in chat content becomes special tokens")
    behind_router: bool = key(False, "set by serve for its dp replicas: the router's placeholder model means none")


@dataclass
class BenchConfig:
    mode: str = key("offline", "online (through the HTTP server) | offline (the engine in process)")
    url: Optional[str] = key(None, "online: an existing server; null -> start one from this config")
    request_rate: float = key(float("inf"), "requests/s (Poisson); inf = all at once")
    burstiness: float = key(1.0, "gamma shape of the arrivals; 1.0 = Poisson")
    max_concurrency: Optional[int] = key(None, "requests in flight at most; null = no limit")
    warmup_requests: int = key(1, "requests run before timing starts")
    stream: bool = key(True, "online: stream the responses (TTFT, ITL)")
    disable_progress: bool = key(False, "hide the progress bar")
    result_file: str = key("results.jsonl", "results file name in the run folder")
    request_timeout_s: float = key(600.0, "online: seconds a request may take")
    dry_run: bool = key(False, "print the validated config of each job and run nothing")


@dataclass
class WorkloadConfig:
    name: str = key("gsm8k_sample", "workload name, recorded with the results")
    kind: str = key("jsonl", "jsonl | fewshot | multiturn | random | json_schema")
    path: Optional[str] = key(None, 'jsonl: file of {"messages": [...], "max_tokens"}; null -> the shipped sample')
    num_prompts: Optional[int] = key(None, "null -> every prompt of the file (jsonl); random needs a number")
    seed: int = key(0, "seed of the prompt sample and random prompts")
    max_tokens: Optional[int] = key(None, "override each request's max_tokens (null -> model.max_new_tokens)")
    input_len: List[int] = key([128], "random: prompt tokens, [fixed] or [low, high]")
    output_len: List[int] = key([128], "random: output tokens, [fixed] or [low, high]")
    scorer: Optional[str] = key(None, "gsm8k: final-number match; arith: the embedded task (strict); json_schema: the reply "
                                                 "validates against its schema; null = unscored")
    num_shots: int = key(5, "fewshot: exemplars (the file's first lines) before every question")
    num_turns: int = key(3, "multiturn: user turns per conversation")
    constrained: bool = key(True, "json_schema: send response_format (false: the same prompts, unconstrained)")


@dataclass
class TrackingConfig:
    backend: str = key("mlflow", "mlflow | none")
    tracking_uri: Optional[str] = key(None, "null -> sqlite:///<cwd>/mlruns/mlflow.db")
    artifact_location: Optional[str] = key(None, "null -> <cwd>/mlruns/artifacts")
    experiment: str = key("fluxlab", "MLflow experiment")
    run_name: Optional[str] = key(None, "MLflow run name (a sweep's parent run); null -> the overrides")


@dataclass
class RunConfig:
    """What serve, bench and generate share: the engine and the server around it."""

    engine: EngineConfig = key(EngineConfig, "device, dtype, memory, KV layout")
    model: ModelConfig = key(ModelConfig, "the checkpoint and its lengths")
    scheduler: SchedulerConfig = key(SchedulerConfig, "who runs each step, and the KV pages")
    attention: AttentionConfig = key(AttentionConfig, "attention backend and CUDA graphs")
    decoding: DecodingConfig = key(DecodingConfig, "how a block's tokens are chosen (defaults; requests may override)")
    parallel: ParallelConfig = key(ParallelConfig, "tensor, expert and data parallelism")
    server: ServerConfig = key(ServerConfig, "the HTTP server")
    recipe_name: Optional[str] = key(None, "set by a recipe, recorded with every run")


@dataclass
class ServeConfig(RunConfig):
    pass


@dataclass
class GenerateConfig(RunConfig):
    prompt: str = key("What is 12 + 30?", "the prompt (the embedded model's task: fluxlab/train/task.py)")
    chat: bool = key(True, "apply the tokenizer's chat template")


@dataclass
class BenchRunConfig(RunConfig):
    bench: BenchConfig = key(BenchConfig, "how requests are sent and timed")
    workload: WorkloadConfig = key(WorkloadConfig, "the prompts")
    tracking: TrackingConfig = key(TrackingConfig, "where results are logged")


@dataclass
class ReportConfig:
    selection: Optional[str] = key(None, "experiment name or parent run id; null -> newest parent run")
    tracking: TrackingConfig = key(TrackingConfig, "where the runs are read from")
    out_dir: str = key("reports", "reports/<name>/ goes under this folder")
    baseline: Optional[int] = key(None, "the sweep job (its number, 0 = the first point) whose outputs every job's token "
                                        "agreement is measured against; null -> job 0")


@dataclass
class CheckpointConfig:
    preset: str = key("tiny", "shapes: tiny, llada2_mini, llada2_flash, ...")
    out: Optional[str] = key(None, "output folder; null -> ./checkpoints/<preset>")
    seed: int = key(0, "seed of the random weights")
    dtype: str = key("float32", "weight dtype: float32 | bfloat16 | float16")


@dataclass
class EnvConfig:
    json: bool = key(False, "print JSON instead of text")


COMMAND_SCHEMAS: dict[str, Any] = {
    "serve": ServeConfig,
    "generate": GenerateConfig,
    "bench": BenchRunConfig,
    "report": ReportConfig,
    "checkpoint": CheckpointConfig,
    "env": EnvConfig,
}


@dataclass(frozen=True)
class SchemaKey:
    name: str  # dotted: decoding.threshold
    help: str
    section: Optional[type]  # the dataclass of a section (engine, decoding, ...); None for a value


def schema_keys(schema: type, prefix: str = "") -> Iterator[SchemaKey]:
    """Every key of a schema, a section before its keys, in declaration order."""
    types = typing.get_type_hints(schema)
    for item in dataclasses.fields(schema):
        name, kind = prefix + item.name, types[item.name]
        section = kind if isinstance(kind, type) and dataclasses.is_dataclass(kind) else None
        yield SchemaKey(name, item.metadata.get("help", ""), section)
        if section is not None:
            yield from schema_keys(section, name + ".")


def register_configs() -> None:
    """Each primary config starts from `<command>_schema`, so every group merged onto it is type-checked."""
    from fluxlab.config.paths import register_resolvers

    register_resolvers()
    cs = ConfigStore.instance()
    for command, schema in COMMAND_SCHEMAS.items():
        cs.store(name=f"{command}_schema", node=schema)
