"""Load a Diffusion-Gemma checkpoint in transformers' layout into fluxlab's DiffusionGemmaModel.

transformers ties the encoder's and the decoder's text weights (and lm_head to the embedding), so
`save_pretrained` writes each shared tensor once, under either `model.encoder.language_model.` or
`model.decoder.`; both prefixes map to the same fluxlab module (a tensor stored under both must then
hold the same values, as transformers ties only equal ones). The exception is each layer's
`layer_scalar` buffer, which is not tied: the encoder's loads into `encoder_layer_scalar`.
A config with tie_word_embeddings=false unties everything: the encoder's tensors load into the
model's `encoder_*` copy and `lm_head.weight` into its own head. Vision weights are skipped.
model.quantization=fp8 (fp8_checkpoint.py): an FP8 checkpoint (config.json quantization_config) loads
its e4m3 tensors and `_scale_inv` scales as they are into the model's FP8 layers; other weights are
quantized once loaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

_TEXT_PREFIXES = ("model.encoder.language_model.", "model.decoder.")
_SKIPPED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


def read_config(path):
    """transformers' DiffusionGemmaConfig from <path>/config.json (its own parsing, so per-layer
    head dims, KV heads and RoPE come out exactly as transformers builds them)."""
    from transformers import DiffusionGemmaConfig

    config_file = Path(path) / "config.json"
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type != "diffusion_gemma":
        raise ValueError(f"{config_file}: model_type is {model_type!r}, expected 'diffusion_gemma'")
    return DiffusionGemmaConfig.from_pretrained(str(path))


def read_text_config(path):
    return read_config(path).text_config


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


def fluxlab_name(checkpoint_name: str, tied: bool = True) -> str | None:
    """Checkpoint tensor name -> DiffusionGemmaModel parameter name (None: not part of the text model)."""
    if checkpoint_name.startswith(_SKIPPED_PREFIXES):
        return None
    if checkpoint_name == "lm_head.weight":
        return "embed_tokens.weight" if tied else "lm_head.weight"
    for prefix in _TEXT_PREFIXES:
        if checkpoint_name.startswith(prefix):
            name = checkpoint_name[len(prefix):]
            if prefix == _TEXT_PREFIXES[0]:
                if name.endswith(".layer_scalar"):
                    return name.removesuffix("layer_scalar") + "encoder_layer_scalar"
                if not tied:
                    return "encoder_" + name
            return name
    raise ValueError(f"unexpected tensor {checkpoint_name!r} in a diffusion_gemma checkpoint")


def load_model(model_cfg, model_dir: Path | None, dtype: torch.dtype, device, seed: int):
    """The engine's model: the checkpoint folder's weights, or random ones of model.preset's shapes
    (model_dir None: model.load_format=random), converted as model.quantization says."""
    quantization = model_cfg.get("quantization", "none")
    if model_dir is not None:
        model = load_diffusion_gemma(model_dir, dtype, device, quantization)
    else:
        from fluxlab.models.diffusion_gemma.fp8_checkpoint import quantize_diffusion_gemma_
        from fluxlab.models.diffusion_gemma.presets import build_random_diffusion_gemma

        model = build_random_diffusion_gemma(model_cfg.preset, dtype, device, seed)
        model = quantize_diffusion_gemma_(model) if quantization == "fp8" else model
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        model.fuse_projections_()  # fp32 and the CPU keep F.linear per projection (parity runs)
        model.dense_beside_experts_(DENSE_BESIDE_EXPERTS_TOKENS)
    return model


# Forwards up to this many tokens (4 canvases, or 2 rows committing a block) run the dense MLP on a second
# stream beside the experts. H200, 26B-A4B, same build, one stream / two streams interleaved (docs/benchmarks.md):
# batch 1 19.57, 19.48 -> 18.62, 18.52 ms (fp8 15.76, 16.28 -> 15.19, 15.23); batch 16 (4096 tokens) gained nothing.
DENSE_BESIDE_EXPERTS_TOKENS = 1024


def load_diffusion_gemma(path, dtype: torch.dtype = torch.float32, device="cpu", quantization: str = "none"):
    """Build DiffusionGemmaModel from <path> and fill every parameter and buffer from its safetensors;
    a missing or wrongly shaped tensor is an error naming it. quantization="fp8": FP8 layers (module doc)."""
    from safetensors import safe_open

    from fluxlab.engine.layers.quantization import fp8_checkpoint
    from fluxlab.models.diffusion_gemma.fp8_checkpoint import fp8_structure_, quantize_diffusion_gemma_
    from fluxlab.models.diffusion_gemma.model import DiffusionGemmaModel

    path = Path(path)
    config = read_config(path)
    fp8_file = fp8_checkpoint(path)
    if fp8_file and quantization != "fp8":
        raise ValueError(f"{path} holds FP8 weights (config.json quantization_config): set model.quantization=fp8 "
                         "to run them")
    tied = bool(config.tie_word_embeddings)
    with torch.device("meta"):
        model = DiffusionGemmaModel(config.text_config, tied=tied)
    model = model.to_empty(device=device).to(dtype)
    if fp8_file:
        fp8_structure_(model)  # after .to(dtype), which would cast the e4m3 weights
    for name, inv_freq in _rope_buffers(model).items():
        setattr(model, name, inv_freq.to(device))  # registered buffer: replaced, kept fp32
    for layer in model.layers if tied else list(model.layers) + list(model.encoder_layers):
        # transformers' init value, used when a checkpoint omits them
        layer.layer_scalar.fill_(1.0)
        layer.encoder_layer_scalar.fill_(1.0)
    targets = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if "inv_freq" not in n}
    filled = set()
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = fluxlab_name(name, tied)
                if target is None:
                    continue
                if target not in targets:
                    raise ValueError(f"{file.name}: tensor {name!r} has no place in DiffusionGemmaModel")
                tensor = _as_target(f.get_tensor(name), targets[target], name)
                if target in filled:  # tied: transformers would not tie different values
                    if not _bit_equal(tensor.to(targets[target].device), targets[target]):
                        raise ValueError(f"{name}: differs from the tensor it is tied to ({target}); the config "
                                         "says tie_word_embeddings=true")
                    continue
                if tuple(tensor.shape) != tuple(targets[target].shape):
                    hint = (" (one 128-row scale grid for the gate half, then one for the up half)"
                            if name.endswith("gate_up_proj_scale_inv") else "")
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)}, model expects "
                                     f"{tuple(targets[target].shape)}{hint}")
                with torch.no_grad():
                    targets[target].copy_(tensor)
                filled.add(target)
    missing = sorted(set(targets) - filled - {n for n in targets if n.endswith("layer_scalar")})
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if quantization == "fp8" and not fp8_file:
        quantize_diffusion_gemma_(model)
    return model.eval()


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal has no float8 kernel on CPU: compare e4m3 codes as bytes
    if a.dtype == b.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _as_target(tensor: torch.Tensor, target: torch.Tensor, name: str) -> torch.Tensor:
    """A checkpoint tensor in its target's dtype; an e4m3 tensor only into an FP8 weight, as it is
    (cast to another dtype, its codes would lose their block scales)."""
    fp8 = torch.float8_e4m3fn
    if (tensor.dtype == fp8) != (target.dtype == fp8):
        raise ValueError(f"{name}: {tensor.dtype} in the checkpoint, but fluxlab holds it as {target.dtype} "
                         "(FP8 are the attention and MLP projections and the routed experts: "
                         "fluxlab/models/diffusion_gemma/fp8_checkpoint.py)")
    return tensor.to(target.dtype)


def _rope_buffers(model) -> dict[str, torch.Tensor]:
    # inv_freq buffers are not in the checkpoint; rebuilt from the config, in fp32 as transformers keeps them.
    from fluxlab.models.diffusion_gemma.model import rope_inv_freqs

    return {f"{t}_inv_freq": f for t, f in rope_inv_freqs(model.config).items()}
