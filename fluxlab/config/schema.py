"""Structured-config schema: one dataclass per config group, registered with Hydra's ConfigStore.

Every YAML under conf/ is merged onto these, so a misspelt key or a wrong type fails at compose
time, before anything heavy loads. Defaults follow the reference system's `launch` flags (DESIGN §3).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class EngineConfig:
    device: str = "auto"  # auto = cuda when a GPU is present, else cpu
    dtype: str = "bfloat16"  # float32 for exact-parity runs
    seed: int = 0
    gpu_memory_utilization: float = 0.90
    gpu_memory_safety_reserve: float = 0.05
    kv_cache_layout: str = "paged"  # paged | dense
    page_size: Optional[int] = None  # null -> decoding.block_length
    cpu_kv_cache_gb: float = 1.0  # KV budget when the engine runs on CPU (no memory profiling there)
    moe_backend: str = "auto"  # CUDA: auto | grouped_mm (torch._grouped_mm) | triton (fluxlab/kernels); torch = loop


@dataclass
class ModelConfig:
    name: str = "tiny_llada2"
    path: Optional[str] = None  # local dir or HF id; null = the embedded tiny checkpoint
    load_format: str = "auto"  # auto (safetensors from path) | random (random weights of `preset`, built on device)
    preset: Optional[str] = None  # shapes for load_format=random: tiny, llada2_mini, llada2_flash, ...
    max_model_len: int = 2048
    max_new_tokens: int = 128
    trust_remote_code: bool = True


@dataclass
class SchedulerConfig:
    policy: str = "paged"  # paged | dynamic
    max_num_seqs: int = 8
    max_scheduled_tokens: int = 512
    num_device_pages: int = 0  # <= 0: profile from free memory (GPU) or engine.cpu_kv_cache_gb (CPU)
    enable_prefix_cache: bool = True  # reuse committed blocks' K/V across requests (paged KV layout)
    # Launch the next forward of the same rows before postprocess when no block finished (vLLM's
    # async scheduling); null = on where it runs (one-GPU LLaDA2 engines), off under TP and Diffusion-Gemma.
    async_scheduling: Optional[bool] = None


@dataclass
class AttentionConfig:
    backend: str = "auto"  # auto = flashinfer on CUDA (triton without it), sdpa on CPU and fp32; sdpa | flashinfer | fa4 | triton
    use_cuda_graph: bool = False  # the reference system's --use-cuda-graph: validate turns on decode graphs
    use_prefill_cuda_graph: bool = False  # prefill / mixed forwards up to cuda_graph_capture_sizes tokens
    use_decode_cuda_graph: bool = False
    cuda_graph_decode_mode: str = "padded"  # padded | decomposed
    cuda_graph_capture_bs: Optional[List[int]] = None  # null -> [1, 2, 4, ..., max_num_seqs]
    cuda_graph_capture_sizes: List[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])


@dataclass
class DecodingConfig:
    decoder: str = "threshold"  # threshold | hierarchy | joint_threshold | levenshtein_joint | canvas
    block_length: int = 64
    canvas_length: int = 128  # Diffusion-Gemma
    max_denoising_steps: Optional[int] = None  # LLaDA2: overrides steps (smoke tests); canvas: steps per canvas
    # canvas decoder (Diffusion-Gemma); null = the checkpoint's generation_config.json
    entropy_bound: Optional[float] = None
    t_min: Optional[float] = None
    t_max: Optional[float] = None
    stability_threshold: Optional[int] = None
    confidence_threshold: Optional[float] = None
    steps: Optional[int] = None  # transfer schedule per block; null -> block_length
    threshold: float = 0.9
    low_threshold: float = 0.3  # hierarchy
    editing_threshold: float = 0.5  # joint_threshold; 0.0 = edit whenever the argmax differs
    max_post_steps: int = 16  # joint_threshold, levenshtein_joint
    max_steps_per_block: int = 1000  # levenshtein_joint: hard cap on forwards per block (>= 2)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off


@dataclass
class ParallelConfig:
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    enable_dp_attention: bool = False
    distributed_backend: str = "nccl"  # gloo is used on CPU
    startup_timeout_s: float = 600.0


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: Optional[str] = None
    served_model_name: Optional[str] = None  # null -> model.name
    max_waiting_requests: int = 1024  # past this the server answers 503
    log_level: str = "info"
    worker_urls: List[str] = field(default_factory=list)  # dp: extra replicas on other hosts
    router_policy: str = "cache_aware"
    health_timeout_s: float = 600.0
    max_request_body_bytes: int = 8 * 1024 * 1024  # larger bodies are a 413 before parsing; <= 0: no limit
    parse_special_tokens_in_chat: bool = False  # true: special-token text in chat content becomes special tokens
    behind_router: bool = False  # set by serve for its dp replicas: the router's placeholder model means "none"


@dataclass
class BenchConfig:
    mode: str = "offline"  # online | offline
    url: Optional[str] = None  # online: an existing server; null -> start one from this config
    request_rate: float = float("inf")  # requests/s (Poisson); inf = all at once
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson
    max_concurrency: Optional[int] = None
    warmup_requests: int = 1
    stream: bool = True
    disable_progress: bool = False
    result_file: str = "results.jsonl"
    request_timeout_s: float = 600.0
    dry_run: bool = False  # print the validated config of each job and run nothing


@dataclass
class WorkloadConfig:
    name: str = "gsm8k_sample"
    kind: str = "jsonl"  # jsonl | fewshot | multiturn | random
    path: Optional[str] = None  # jsonl: file of {"messages": [...], "max_tokens"}; null -> the shipped sample
    num_prompts: Optional[int] = None  # null -> every prompt of the file (jsonl); random needs a number
    seed: int = 0
    max_tokens: Optional[int] = None  # override each request's max_tokens (null -> model.max_new_tokens)
    input_len: List[int] = field(default_factory=lambda: [128])  # random: [fixed] or [low, high]
    output_len: List[int] = field(default_factory=lambda: [128])
    scorer: Optional[str] = None  # gsm8k: final-number match; arith: the embedded task (strict)
    num_shots: int = 5  # fewshot: exemplars (the file's first lines) before every question
    num_turns: int = 3  # multiturn: user turns per conversation


@dataclass
class TrackingConfig:
    backend: str = "mlflow"  # mlflow | none
    tracking_uri: Optional[str] = None  # null -> sqlite:///<cwd>/mlruns/mlflow.db
    artifact_location: Optional[str] = None  # null -> <cwd>/mlruns/artifacts
    experiment: str = "fluxlab"
    run_name: Optional[str] = None


@dataclass
class RunConfig:
    """What serve, bench and generate share: the engine and the server around it."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    recipe_name: Optional[str] = None  # set by a recipe, recorded with every run


@dataclass
class ServeConfig(RunConfig):
    pass


@dataclass
class GenerateConfig(RunConfig):
    prompt: str = "What is 12 + 30?"  # the embedded model's task (fluxlab/train/task.py)
    chat: bool = True  # apply the tokenizer's chat template


@dataclass
class BenchRunConfig(RunConfig):
    bench: BenchConfig = field(default_factory=BenchConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


@dataclass
class ReportConfig:
    selection: Optional[str] = None  # experiment name or parent run id; null -> newest parent run
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    out_dir: str = "reports"


@dataclass
class CheckpointConfig:
    preset: str = "tiny"
    out: Optional[str] = None  # null -> ./checkpoints/<preset>
    seed: int = 0
    dtype: str = "float32"


@dataclass
class EnvConfig:
    json: bool = False


COMMAND_SCHEMAS: dict[str, Any] = {
    "serve": ServeConfig,
    "generate": GenerateConfig,
    "bench": BenchRunConfig,
    "report": ReportConfig,
    "checkpoint": CheckpointConfig,
    "env": EnvConfig,
}


def register_configs() -> None:
    """Each primary config starts from `<command>_schema`, so every group merged onto it is type-checked."""
    from fluxlab.config.compose import register_resolvers

    register_resolvers()
    cs = ConfigStore.instance()
    for command, schema in COMMAND_SCHEMAS.items():
        cs.store(name=f"{command}_schema", node=schema)
