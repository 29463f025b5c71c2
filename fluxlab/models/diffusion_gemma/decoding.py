"""Diffusion-Gemma canvas decoding: transformers' entropy-bound sampler, one step per forward.

The definition of right is transformers' `DiffusionGemmaGenerationMixin.generate`
(models/diffusion_gemma/generation_diffusion_gemma.py, 5.24). For one request at batch 1 it does,
per canvas: draw a uniform random canvas; then for cur_step = N .. 1 (N = max_denoising_steps):
1. logits / T with T = t_min + (t_max - t_min) * (cur_step / N), in float32 (a 0-dim tensor);
2. sample every position (multinomial over the softmax), argmax of the same logits;
3. accept the k lowest-entropy positions whose entropy sum minus its largest term is <= the bound;
4. renoise: a whole fresh random canvas, keeping the accepted positions;
5. stop once the argmax canvas equals the last `stability_threshold` argmax canvases and the mean
   entropy is below `confidence_threshold`;
6. the temperature-scaled logits come back next step as self-conditioning.
The committed canvas is the last step's *argmax* canvas (not the accepted one), encoded causally.

Each request owns a torch.Generator seeded with its seed and consumes it in exactly that order
(canvas init, then per step: multinomial over the canvas, randint over the canvas), so its tokens
do not depend on the batch it runs in. Everything else is vectorised over the batch's rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fluxlab.engine.decoding.base import Decoder
from fluxlab.models.registry import DIFFUSION_GEMMA

# Transformers' global defaults (DiffusionGemmaGenerationConfig._get_default_generation_params), used for
# knobs a checkpoint's generation_config.json leaves unset, or when there is no checkpoint (random weights).
TRANSFORMERS_DEFAULTS = dict(max_denoising_steps=48, entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1,
                             confidence_threshold=0.005)
CANVAS_KNOBS = DIFFUSION_GEMMA.knobs
assert set(CANVAS_KNOBS) == set(TRANSFORMERS_DEFAULTS), "the registry's canvas knobs are transformers' knobs"


class Canvas(Decoder):
    """Registry entry of the canvas decoder (names, knobs, checks). Its step is `canvas_step`, run by
    the canvas runner (canvas_runner.py): it draws from a per-request generator and carries float
    state (self-conditioning) that the mask-filling protocol's DecodeBatch has no place for."""

    name = "canvas"
    knobs = ()  # its knobs (CANVAS_KNOBS) live on the request as CanvasKnobs, not in the seat table
    needs_logits = True

    def step(self, batch):
        raise TypeError("decoder 'canvas' runs in the canvas runner (Diffusion-Gemma models only)")


@dataclass(frozen=True)
class CanvasKnobs:
    max_denoising_steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    stability_threshold: int
    confidence_threshold: float

    def temperature(self, forwards_done: int) -> float:
        """The schedule's temperature for the next forward, bit-exact with transformers: its
        cur_step counts down N..1 and the arithmetic runs on a 0-dim int32 tensor (float32 result)."""
        # (a constrained canvas may denoise past N forwards, docs/structured_output.md: it keeps the last
        # temperature, cur_step 1; an unconstrained one is final at its N-th, so this never binds for it)
        cur_step = torch.tensor(max(1, self.max_denoising_steps - forwards_done), dtype=torch.int32)
        return float(self.t_min + ((self.t_max - self.t_min) * (cur_step / self.max_denoising_steps)))


def read_generation_defaults(model_dir) -> dict:
    """The canvas knobs of a checkpoint's generation_config.json (transformers' own parsing),
    transformers' global defaults for the ones it leaves unset."""
    from pathlib import Path

    out = dict(TRANSFORMERS_DEFAULTS)
    if model_dir is None or not (Path(model_dir) / "generation_config.json").is_file():
        return out
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    g = DiffusionGemmaGenerationConfig.from_pretrained(str(model_dir))
    values = dict(max_denoising_steps=g.max_denoising_steps, t_min=g.t_min, t_max=g.t_max,
                  stability_threshold=g.stability_threshold, confidence_threshold=g.confidence_threshold,
                  entropy_bound=g.sampler_config.entropy_bound if g.sampler_config is not None else None)
    out.update({k: v for k, v in values.items() if v is not None})
    return out


class CanvasState:
    """One request's denoising state on the device. It lives on the request, so preemption (which
    frees pages only) keeps it, and the generator is consumed once per draw whatever the batch."""

    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.forwards = 0  # denoiser forwards on the current canvas
        self.needs_canvas = True  # the next canvas' random start is not drawn yet
        self.canvas: Optional[torch.Tensor] = None  # [L] the canvas the next forward denoises
        self.prev_argmax: Optional[torch.Tensor] = None  # [L] argmax canvas of the previous step
        self.stable_run: Optional[torch.Tensor] = None  # 0-dim: consecutive previous steps with that argmax
        self.soft_embeds: Optional[torch.Tensor] = None  # [L, H] self-conditioning input (None: zeros)
        # a constrained request's decided positions (constrained.py; host, UNDECIDED where not): None = none
        self.decided: Optional[np.ndarray] = None

    def draw_canvas(self, vocab_size: int, canvas_length: int) -> torch.Tensor:
        """A uniform random canvas [L] (transformers' initialize_canvas at batch 1)."""
        return draw_canvas(self.generator, vocab_size, canvas_length)

    _FIELDS = ("forwards", "needs_canvas", "canvas", "prev_argmax", "stable_run", "soft_embeds", "decided")

    def snapshot(self) -> tuple:
        """The state before a step (a step replaces these tensors, never writes into them)."""
        return self.generator.get_state(), tuple(getattr(self, f) for f in self._FIELDS)

    def restore(self, snapshot: tuple) -> None:
        generator_state, values = snapshot
        self.generator.set_state(generator_state)
        for name, value in zip(self._FIELDS, values):
            setattr(self, name, value)

    def enter_canvas(self) -> None:
        self.forwards = 0
        self.prev_argmax = self.stable_run = self.soft_embeds = self.decided = None


@dataclass
class CanvasStepInputs:
    """A step's per-row knobs and stopping history as tensors ([R] unless noted). The eager path
    builds them from the states (`of`); the static path (canvas_graphs.py) keeps them in fixed
    buffers that a captured graph reads."""

    temperature: torch.Tensor  # float32: the schedule's temperature for this forward
    entropy_bound: torch.Tensor  # float32
    confidence_threshold: torch.Tensor  # float32
    stability_threshold: torch.Tensor  # long
    last: torch.Tensor  # bool: this forward is the canvas' max_denoising_steps-th
    prev_argmax: torch.Tensor  # [R, L] long: the previous step's argmax canvas, -1 before the first
    stable_run: torch.Tensor  # long: consecutive previous steps with that argmax (0 before the first)

    @staticmethod
    def host_values(states: list[CanvasState], knobs: list[CanvasKnobs]) -> tuple[list, list]:
        """(float rows [temperature, entropy_bound, confidence_threshold], int rows
        [stability_threshold, last]) of these rows, as host lists."""
        floats = [[k.temperature(s.forwards) for k, s in zip(knobs, states)], [k.entropy_bound for k in knobs],
                  [k.confidence_threshold for k in knobs]]
        ints = [[k.stability_threshold for k in knobs],
                [int(s.forwards + 1 >= k.max_denoising_steps) for s, k in zip(states, knobs)]]
        return floats, ints

    @classmethod
    def of(cls, states: list[CanvasState], knobs: list[CanvasKnobs], length: int,
           device: torch.device) -> "CanvasStepInputs":
        floats, ints = cls.host_values(states, knobs)
        f = torch.tensor(floats, dtype=torch.float32, device=device)
        i = torch.tensor(ints, dtype=torch.long, device=device)
        prev = torch.stack([s.prev_argmax if s.prev_argmax is not None
                            else torch.full((length,), -1, dtype=torch.long, device=device) for s in states])
        zero = torch.zeros((), dtype=torch.long, device=device)
        run = torch.stack([s.stable_run if s.stable_run is not None else zero for s in states])
        return cls(f[0], f[1], f[2], i[0], i[1].bool(), prev, run)


@dataclass
class CanvasStepResult:
    block: torch.Tensor  # [R, L] the next forward's canvas, or the committed argmax canvas where final
    final: torch.Tensor  # [R] bool
    accepted: torch.Tensor  # [R] positions accepted this step
    processed: Optional[torch.Tensor]  # [R, L, V] temperature-scaled logits (None from the CUDA kernel)
    probs: torch.Tensor  # [R, L, V] softmax(processed), fp32 (the CUDA kernel: model dtype): self-conditioning
    argmax: torch.Tensor  # [R, L] argmax canvas (the next step's prev_argmax)
    stable_run: torch.Tensor  # [R] the next step's stable_run
    taken: Optional[torch.Tensor] = None  # [R, L] bool: the positions accepted this step
    noise: Optional[torch.Tensor] = None  # [R, L] the renoise draw (the canvas where not accepted)


def denoise_step(logits: torch.Tensor, current: torch.Tensor, inputs: CanvasStepInputs,
                 generators: list[torch.Generator], inplace: bool = False, raw: bool = False,
                 softcap: Optional[float] = None) -> CanvasStepResult:
    """One denoising step for R rows, tensors only (no host sync, so a CUDA graph can hold it):
    logits [R, L, V] (fp32 soft-capped; or, raw=True, the head's output, soft-capped here by `softcap`),
    the canvases the forward read [R, L], row r drawing from generators[r] (its multinomial over
    the canvas, then its renoise canvas). inplace: `logits` may be overwritten (the engine's).

    On CPU every value is the one transformers' ops give: soft-cap, temperature, softmax (used
    twice: the multinomial and the self-conditioning input, which is what transformers feeds back),
    Categorical's entropy with its temporaries in place; torch.multinomial's own one-sample path is
    argmax(p / q), q ~ Exp(1), drawn by `exponential_` from the same generator, so it runs as that
    over one noise tensor for all rows. On CUDA the argmax, probabilities, entropy and the draw come
    from two passes over the raw logits (fluxlab/kernels/canvas_stats.py) instead of ~30 fp32 ones."""
    from fluxlab.kernels.canvas_stats import canvas_stats, use_kernel

    rows, length, vocab = logits.shape
    processed = None
    exp_noise = torch.empty(rows, length, vocab, dtype=torch.float32, device=logits.device)
    for r, g in enumerate(generators):  # each row's multinomial noise first (transformers' order)
        exp_noise[r].exponential_(1, generator=g)
    if raw and use_kernel(logits):
        temperature = inputs.temperature[:, None].expand(rows, length).reshape(-1)
        argmax, entropy, probs, sampled = canvas_stats(logits.view(rows * length, vocab), temperature, softcap,
                                                       exp_noise.view(rows * length, vocab), logits.dtype)
        argmax, entropy, sampled = (t.view(rows, length) for t in (argmax, entropy, sampled))
        probs = probs.view(rows, length, vocab)
    else:
        if raw:  # compute_logits' ops
            logits = logits.float() if inplace else logits.float().clone()
            if softcap:
                logits.div_(softcap).tanh_().mul_(softcap)
            inplace = True
        temperature = inputs.temperature[:, None, None]
        processed = logits.div_(temperature) if inplace else logits / temperature
        probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
        sampled = torch.div(probs, exp_noise, out=exp_noise).argmax(dim=-1)
        argmax = processed.argmax(dim=-1)
        entropy = _entropy(processed)  # [R, L]
    del exp_noise
    sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)
    selected = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= inputs.entropy_bound[:, None]
    accepted = torch.scatter(torch.zeros_like(selected), dim=-1, index=order, src=selected)
    kept = torch.where(accepted, sampled, current)
    noise = torch.stack([draw_canvas(g, vocab, length) for g in generators])
    renoised = torch.where(accepted, kept, noise)
    # Stable: this argmax equals each of the last S (the history starts as -1, so S steps are needed).
    same = (argmax == inputs.prev_argmax).all(dim=-1)
    run = inputs.stable_run
    stable = (inputs.stability_threshold == 0) | (same & (run >= inputs.stability_threshold))
    new_run = torch.where(same, run + 1, torch.ones_like(run))
    confident = entropy.mean(dim=-1) < inputs.confidence_threshold
    final = (stable & confident) | inputs.last
    block = torch.where(final[:, None], argmax, renoised)
    return CanvasStepResult(block, final, accepted.sum(dim=-1), processed, probs, argmax, new_run, accepted, noise)


def _entropy(processed: torch.Tensor) -> torch.Tensor:
    """Categorical(logits=processed).entropy() (what transformers calls), op for op, with its
    temporaries reused in place: -sum(clamp(x - lse) * softmax(x - lse))."""
    normalized = processed - processed.logsumexp(dim=-1, keepdim=True)
    p = torch.softmax(normalized, dim=-1)
    return -normalized.clamp_(min=torch.finfo(normalized.dtype).min).mul_(p).sum(-1)


def draw_canvas(generator: torch.Generator, vocab_size: int, canvas_length: int) -> torch.Tensor:
    """A uniform random canvas [L] (transformers' initialize_canvas / renoise draw at batch 1)."""
    return torch.randint(0, vocab_size, (1, canvas_length), generator=generator, device=generator.device)[0]


def canvas_step(logits: torch.Tensor, current: torch.Tensor, states: list[CanvasState],
                knobs: list[CanvasKnobs], inplace: bool = False, raw: bool = False,
                softcap: Optional[float] = None) -> CanvasStepResult:
    """`denoise_step` for these requests' states; advances each state's stopping history and step
    count (the caller stores the canvas and the self-conditioning input)."""
    inputs = CanvasStepInputs.of(states, knobs, logits.shape[1], logits.device)
    step = denoise_step(logits, current, inputs, [s.generator for s in states], inplace, raw, softcap)
    for r, s in enumerate(states):
        s.prev_argmax, s.stable_run = step.argmax[r], step.stable_run[r]
        s.forwards += 1
    return step
