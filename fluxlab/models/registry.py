"""The model-family registry: a checkpoint's config.json -> its family, and what fluxlab needs to know
about that family before anything loads (its model and decoder groups, its presets, which config.json
keys a checkpoint folder carries into the run config).

A family is one package, fluxlab/models/<family>/, and one line here: `package` is where its code
lives (`hooks()` imports `<package>.family`, the functions the engine and the checkpoint command ask
it for), `engine` the engine class that decodes it ("module:Class", imported only when a run starts).
docs/models.md says how to add one.

Keyed like vLLM's (`model_executor/models/registry.py`) on config.json `architectures`, with
`model_type` as the fallback; LLaDA2.0/2.1 and LLaDA2.2 share both, and a LLaDA2.2 config is the one
with block routing (`expert_capacity` > 0, DESIGN §4b). Torch-free: config validation, checkpoint-folder
detection (fluxlab/config/model_folder.py) and the engine factory read it.
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional


class UnknownModelFamily(ValueError):
    """A checkpoint folder no registered family reads (or no checkpoint folder at all)."""


@dataclass(frozen=True)
class Family:
    name: str
    title: str  # for messages: "LLaDA2.2"
    model_type: str  # config.json model_type
    architectures: tuple[str, ...]  # config.json architectures
    group: str  # the conf/model group a checkpoint folder of this family starts from
    decoding: str  # the conf/decoding group its model groups select
    presets: tuple[str, ...]  # model.preset values of this family's shapes
    package: str  # fluxlab.models.<family>: the family's code
    engine: str = "fluxlab.engine.llm_engine:LLMEngine"  # the engine class that decodes it (module:Class)
    tiny_presets: tuple[str, ...] = ()  # presets whose files fluxlab writes and caches (tests, the default run)
    parallel: bool = False  # the block engine's tensor/expert parallelism runs it (parallel.tp_size > 1)
    block_routing: bool = False  # config.json expert_capacity > 0 (LLaDA2.2)
    canvas: bool = False  # decodes canvases, not blocks (fluxlab/models/diffusion_gemma/engine.py)
    fp8_weights: bool = False  # its loader reads model.quantization=fp8 (docs/quantization.md)
    # config.json key -> run-config key, set from a checkpoint folder unless the user sets it
    carry: Mapping[str, str] = field(default_factory=dict)
    # decoders of its own (name -> "module:Class"), beside the block decoders of fluxlab/engine/decoding/
    decoders: Mapping[str, str] = field(default_factory=dict)
    # decoding knobs only its own decoders read (defined in fluxlab/engine/decoding/knobs.py with the rest)
    knobs: tuple[str, ...] = ()

    def reads(self, config: dict) -> bool:
        """Whether a checkpoint with this config.json is of this family."""
        named = bool(set(self.architectures) & set(config.get("architectures") or ())) or \
            config.get("model_type") == self.model_type
        return named and self.block_routing == bool(config.get("expert_capacity") or 0)

    def refuses(self, decoder: str) -> bool:
        """Whether `decoder` is another family's own (Family.decoders), which this family's models do not run."""
        return decoder in FAMILY_DECODERS and decoder not in self.decoders

    def hooks(self):
        """`<package>.family`: what the engine core and the checkpoint command ask this family for."""
        return importlib.import_module(f"{self.package}.family")

    def engine_class(self) -> type:
        return load_class(self.engine)


LLADA2 = Family("llada2", "LLaDA2.0/2.1", "llada2_moe", ("LLaDA2MoeModelLM",), group="llada2_mini",
                decoding="threshold",
                presets=("tiny", "small", "llada2_mini", "llada2_flash", "llada21_mini", "llada21_flash"),
                package="fluxlab.models.llada2", tiny_presets=("tiny",), parallel=True, fp8_weights=True)
LLADA22 = Family("llada22", "LLaDA2.2", "llada2_moe", ("LLaDA2MoeModelLM",), group="llada22_mini",
                 decoding="threshold", presets=("tiny_llada22", "llada22_mini", "llada22_flash"),
                 package="fluxlab.models.llada2", tiny_presets=("tiny_llada22",), parallel=True, block_routing=True,
                 fp8_weights=True)
DIFFUSION_GEMMA = Family("diffusion_gemma", "Diffusion-Gemma", "diffusion_gemma", ("DiffusionGemmaForBlockDiffusion",),
                         group="diffusion_gemma", decoding="canvas",
                         presets=("tiny_diffusion_gemma", "diffusion_gemma_26b_a4b"),
                         package="fluxlab.models.diffusion_gemma", engine="fluxlab.models.diffusion_gemma.engine:CanvasEngine",
                         tiny_presets=("tiny_diffusion_gemma",), canvas=True, fp8_weights=True,
                         carry={"canvas_length": "decoding.canvas_length"},
                         decoders={"canvas": "fluxlab.models.diffusion_gemma.decoding:Canvas"},
                         knobs=("max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
                                "confidence_threshold"))

# SDAR / TraDo (JetAstra/SDAR, Gen-Verse TraDo): model_type sdar (dense) and sdar_moe, one package; the two
# published decoding routines are its own block decoders (generate.py's in fluxlab/models/sdar/low_confidence.py,
# huggingface_bd3.py's in bd3.py), beside the core block decoders.
SDAR_DECODERS = {"low_confidence_dynamic": "fluxlab.models.sdar.low_confidence:LowConfidenceDynamic",
                 "low_confidence_static": "fluxlab.models.sdar.low_confidence:LowConfidenceStatic",
                 "sequential": "fluxlab.models.sdar.low_confidence:Sequential",
                 "bd3": "fluxlab.models.sdar.bd3:Bd3"}
SDAR = Family("sdar", "SDAR", "sdar", ("SDARForCausalLM",), group="sdar_8b", decoding="sdar",
              presets=("tiny_sdar", "sdar_8b"), package="fluxlab.models.sdar", tiny_presets=("tiny_sdar",),
              decoders=SDAR_DECODERS)
SDAR_MOE = Family("sdar_moe", "SDAR-MoE", "sdar_moe", ("SDARMoeForCausalLM",), group="sdar_30b_a3b", decoding="sdar",
                  presets=("tiny_sdar_moe", "sdar_30b_a3b"), package="fluxlab.models.sdar",
                  tiny_presets=("tiny_sdar_moe",), decoders=SDAR_DECODERS)

FAMILIES: tuple[Family, ...] = (LLADA2, LLADA22, DIFFUSION_GEMMA, SDAR, SDAR_MOE)
PRESETS: tuple[str, ...] = tuple(p for f in FAMILIES for p in f.presets)
TINY_PRESETS: tuple[str, ...] = tuple(p for f in FAMILIES for p in f.tiny_presets)
# Knobs and decoders some family brings for itself: a model of another family refuses them.
FAMILY_KNOBS: tuple[str, ...] = tuple(dict.fromkeys(k for f in FAMILIES for k in f.knobs))
FAMILY_DECODERS: dict[str, str] = {name: where for f in FAMILIES for name, where in f.decoders.items()}


def load_class(where: str) -> type:
    """"module:Class" -> the class (a family's engine or decoder, imported when first asked for)."""
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)
# A model config naming neither a checkpoint folder nor a preset: LLaDA2 (the embedded default's family).
DEFAULT = LLADA2


def supported() -> str:
    """'llada2_moe (LLaDA2MoeModelLM: LLaDA2.0/2.1, LLaDA2.2), diffusion_gemma (...)' for messages."""
    by_type: dict[str, tuple[tuple[str, ...], list[str]]] = {}
    for family in FAMILIES:
        by_type.setdefault(family.model_type, (family.architectures, []))[1].append(family.title)
    return ", ".join(f"{t} ({'/'.join(arch)}: {', '.join(titles)})" for t, (arch, titles) in by_type.items())


def read_config(folder) -> dict:
    """config.json of a checkpoint folder; UnknownModelFamily when it has none."""
    path = Path(str(folder)).expanduser() / "config.json"
    if not path.is_file():
        raise UnknownModelFamily(f"model.path={folder} has no config.json: a checkpoint folder holds config.json "
                                 f"(model_type, architectures), the weights and the tokenizer")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UnknownModelFamily(f"model.path={folder}: config.json is not valid JSON ({err})") from None


def family_of_config(config: dict, where: str = "config.json") -> Family:
    for family in FAMILIES:
        if family.reads(config):
            return family
    raise UnknownModelFamily(f"{where}: model_type={config.get('model_type')!r} (architectures="
                             f"{config.get('architectures')}) is not a supported model family; supported: {supported()}")


def family_of_folder(folder) -> Family:
    return family_of_config(read_config(folder), f"model.path={folder} config.json")


def family_of_preset(preset: Optional[str]) -> Optional[Family]:
    return next((f for f in FAMILIES if preset in f.presets), None)


def _folder(model) -> Optional[Path]:
    """model.path when it is a folder on this machine (an HF id or a missing path is not)."""
    if model.path is None:
        return None
    path = Path(str(model.path)).expanduser()
    return path if path.is_dir() else None


def family_of_model(model) -> Family:
    """The family of a run config's `model` section: model.path's config.json when that folder is here,
    else model.preset's family, else DEFAULT. UnknownModelFamily for a folder no family reads."""
    folder = _folder(model)
    if folder is not None:
        return family_of_folder(model.path)
    return family_of_preset(model.preset) or DEFAULT


def describe(model) -> str:
    """The model as messages name it: the folder and its model_type when it is read from one, else the group."""
    folder = _folder(model)
    if folder is not None and (folder / "config.json").is_file():
        try:
            model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        except json.JSONDecodeError:
            model_type = None
        return f"model.path={model.path} (model_type {model_type})"
    return f"model={model.name}"


def owner_of(knob_or_decoder: str) -> Family:
    """The family whose own decoders read this knob, or that brings this decoder."""
    return next(f for f in FAMILIES if knob_or_decoder in f.knobs or knob_or_decoder in f.decoders)
