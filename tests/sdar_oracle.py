"""The published SDAR code as a test oracle (tests/reference_sdar/, unmodified files with source headers).

The files target transformers 4.52 with flash-attn on CUDA; this environment has transformers 5.x on CPU and no
flash-attn. `load()` imports them with the smallest shims that let them run, none of which changes their
arithmetic at fp32:

1. `flash_attn.ops.triton.layer_norm.rms_norm_fn` (SDARRMSNorm.forward calls it) is the torch RMSNorm that the
   modeling file itself keeps, commented out, under that call: normalise in fp32, cast back, times the weight.
   `flash_attn.flash_attn_func` is only reached for one-token queries with a cache (q_len == 1), which block
   diffusion never runs; the stub raises if it is ever called.
2. transformers 5 dropped names the file imports: `transformers.modeling_attn_mask_utils.AttentionMaskConverter`
   (used only by `_update_causal_mask`, which the file never calls) and `transformers.utils.LossKwargs` (a typing
   base) get empty stand-ins; `ROPE_INIT_FUNCTIONS["default"]` gets back transformers 4.52's default RoPE
   (inv_freq = 1 / theta ** (arange(0, dim, 2) / dim)); `DynamicCache[i]` (removed in 5) returns layer i's
   (keys, values) as in 4.52.
3. huggingface_bd3.py is an OpenCompass model file: its module-level imports of mmengine/opencompass (and einops
   where it is not installed) get stand-ins (only `block_diffusion_generate` and its helpers are used; a stand-in
   function that is called raises).
4. The published generate routines (JetAstra/SDAR generate.py, huggingface_bd3.py) pass a [1, Q, K] block mask;
   this modeling file (TraDo's, Gen-Verse/dLLM-RL: the JetLM hub files are not reachable here) slices it as
   [B, 1, Q, K]. `load_model` adds a pre-hook on SDARModel that inserts the head axis into a 3-D mask, the
   broadcast SDPA would apply to it anyway.
5. transformers 5 reads `_tied_weights_keys` as a {tied: source} dict; the file's 4.52 list ["lm_head.weight"]
   meant the head tied to the input embedding, so the class gets {"lm_head.weight": "model.embed_tokens.weight"}.
6. config.json needs pad_token_id under transformers 5 (4.52's PretrainedConfig defaulted it); fluxlab's
   checkpoint writer writes one.
7. MoE: no published SDAR MoE modeling file (modeling_sdar_moe.py of SDAR-30B-A3B) is reachable from here. For an
   sdar_moe folder the oracle is the published dense modeling with each MoE layer's MLP replaced by transformers'
   own Qwen3MoeSparseMoeBlock (softmax router, top-k, norm_topk_prob: the Qwen3-MoE block SDAR-30B-A3B is built
   from), its weights stacked from the checkpoint's per-expert tensors.
8. transformers 5's from_pretrained builds the model on the meta device and re-initialises non-persistent buffers
   through `_init_weights`, which this file's does not cover: SDARRotaryEmbedding.inv_freq is left as garbage.
   `load_model` sets it to what the module's own __init__ computes (rope_init_fn(config)).
9. transformers 5's auto_docstring logs "[ERROR] ... not documented" for the files' undocumented arguments while
   they import; that is a docstring lint, not a failure.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import TypedDict

import torch

ROOT = Path(__file__).parent / "reference_sdar"
PACKAGE = "sdar_published"


class LossKwargs(TypedDict, total=False):
    """transformers 4.52's typing base of the loss keyword arguments (gone in 5)."""


def _rms_norm_fn(hidden_states, weight, bias=None, eps=1e-6, **_):
    assert bias is None
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def _flash_attn_func(*args, **kwargs):
    raise AssertionError("flash_attn_func reached: the oracle runs only multi-token (block) queries")


def _unused(name: str):
    def call(*args, **kwargs):
        raise AssertionError(f"{name} stand-in called")
    return call


def _module(name: str, **attrs) -> types.ModuleType:
    module = sys.modules.get(name) or types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    sys.modules[name] = module
    return module


def _default_rope(config, device=None, seq_len=None, **_):
    base = config.rope_theta
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    return inv_freq, 1.0


def _install_shims() -> None:
    import transformers.activations  # noqa: F401  (probes flash_attn on import: before the stand-ins below)
    import transformers.generation  # noqa: F401
    import transformers.integrations  # noqa: F401
    import transformers.modeling_flash_attention_utils  # noqa: F401
    import transformers.modeling_layers  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    import transformers.utils
    from transformers.cache_utils import DynamicCache
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    try:
        import transformers.modeling_attn_mask_utils  # noqa: F401
    except ImportError:
        _module("transformers.modeling_attn_mask_utils", AttentionMaskConverter=type("AttentionMaskConverter", (), {}))
    if not hasattr(transformers.utils, "LossKwargs"):
        transformers.utils.LossKwargs = LossKwargs
    ROPE_INIT_FUNCTIONS.setdefault("default", _default_rope)
    if not hasattr(DynamicCache, "__getitem__"):
        DynamicCache.__getitem__ = lambda self, i: (self.layers[i].keys, self.layers[i].values)
    if "einops" not in sys.modules and importlib.util.find_spec("einops") is None:  # imported by huggingface_bd3.py, never called on its generate path
        _module("einops", rearrange=_unused("einops.rearrange"))
    for name in ("mmengine", "mmengine.device", "opencompass", "opencompass.models", "opencompass.models.base",
                 "opencompass.models.base_api", "opencompass.registry", "opencompass.utils",
                 "opencompass.utils.logging", "opencompass.utils.prompt"):
        _module(name)
    registry = types.SimpleNamespace(register_module=lambda *a, **k: (lambda cls: cls))
    _module("mmengine.device", is_npu_available=lambda: False)
    _module("opencompass.models.base", BaseModel=object, LMTemplateParser=object)
    _module("opencompass.models.base_api", APITemplateParser=object)
    _module("opencompass.registry", MODELS=registry)
    _module("opencompass.utils.logging", get_logger=lambda *a, **k: None)
    _module("opencompass.utils.prompt", PromptList=list)


def _import(name: str):
    full = f"{PACKAGE}.{name}"
    if full in sys.modules:
        return sys.modules[full]
    spec = importlib.util.spec_from_file_location(full, ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    return module


def load():
    """-> namespace(modeling, configuration, generate, bd3): the published modules."""
    _install_shims()
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(ROOT)]
        sys.modules[PACKAGE] = package
    configuration = _import("configuration_sdar")
    # flash_attn stand-ins only while the modeling file imports them: transformers probes the real package
    # later (find_spec), and must keep seeing that it is absent.
    stubs = ("flash_attn", "flash_attn.ops", "flash_attn.ops.triton", "flash_attn.ops.triton.layer_norm")
    _module("flash_attn", flash_attn_func=_flash_attn_func)
    _module("flash_attn.ops")
    _module("flash_attn.ops.triton")
    _module("flash_attn.ops.triton.layer_norm", rms_norm_fn=_rms_norm_fn)
    try:
        modeling = _import("modeling_sdar")
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
    if isinstance(modeling.SDARForCausalLM._tied_weights_keys, list):
        modeling.SDARForCausalLM._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    return types.SimpleNamespace(configuration=configuration, modeling=modeling, generate=_import("generate"),
                                 bd3=_import("huggingface_bd3"))


def load_model(folder, dtype=torch.float32):
    """The published SDARForCausalLM read from a checkpoint folder (sdpa attention, eval mode); for an
    sdar_moe folder, the MoE stand-in of shim 7."""
    import json

    published = load()
    config = json.loads((Path(folder) / "config.json").read_text())
    if config["model_type"] == "sdar_moe":
        model = _moe_model(published, folder, config, dtype)
    else:
        model = published.modeling.SDARForCausalLM.from_pretrained(str(folder), torch_dtype=dtype,
                                                                   attn_implementation="sdpa")
    rotary = model.model.rotary_emb  # shim 9: the buffer from_pretrained leaves uninitialised, as __init__ computes it
    rotary.inv_freq = rotary.rope_init_fn(rotary.config, rotary.inv_freq.device)[0].to(rotary.inv_freq.dtype)
    rotary.original_inv_freq = rotary.inv_freq
    model.model.register_forward_pre_hook(_mask_with_head_axis, with_kwargs=True)
    return model.eval()


def _moe_model(published, folder, config: dict, dtype):
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = published.configuration.SDARConfig(**{k: v for k, v in config.items() if k not in ("model_type",)})
    cfg._attn_implementation = "sdpa"
    model = published.modeling.SDARForCausalLM(cfg).to(dtype)
    moe_cfg = Qwen3MoeConfig(hidden_size=cfg.hidden_size, moe_intermediate_size=config["moe_intermediate_size"],
                             num_experts=config["num_experts"], num_experts_per_tok=config["num_experts_per_tok"],
                             norm_topk_prob=config["norm_topk_prob"], hidden_act="silu")
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    state = {}
    experts = config["num_experts"]
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}.mlp."
        if f"{prefix}gate.weight" not in tensors:
            continue
        layer.mlp = Qwen3MoeSparseMoeBlock(moe_cfg).to(dtype)
        state[f"{prefix}gate.weight"] = tensors.pop(f"{prefix}gate.weight")
        state[f"{prefix}experts.gate_up_proj"] = torch.stack([torch.cat(
            [tensors.pop(f"{prefix}experts.{e}.gate_proj.weight"), tensors.pop(f"{prefix}experts.{e}.up_proj.weight")])
            for e in range(experts)])
        state[f"{prefix}experts.down_proj"] = torch.stack(
            [tensors.pop(f"{prefix}experts.{e}.down_proj.weight") for e in range(experts)])
    state.update(tensors)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def _mask_with_head_axis(module, args, kwargs):
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 3:
        kwargs["attention_mask"] = mask[:, None]
    return args, kwargs
