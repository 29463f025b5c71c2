"""Diffusion-Gemma (`model_type: diffusion_gemma`, text part), written for the engine.

One stack of Gemma-4 text layers serves both passes, as in transformers, where the encoder and the
decoder tie every text weight:
- `encode(ids, positions, attn)`: the prompt, or a committed canvas, causal; the backend writes K/V.
- `denoise(canvas_ids, positions, attn, self_conditioning_logits)`: a canvas, bidirectional over
  prefix + canvas, no K/V writes; the previous step's logits come back in as soft embeddings
  through the self-conditioning MLP (zeros on the first step).
- `forward(ids, positions, attn, is_canvas, soft_embeds)`: both in one flattened batch (the engine's).
- `forward_canvas(ids, positions, attn, soft_embeds)`: canvas tokens only, static shapes, no host
  sync (the denoiser CUDA graphs, canvas_static.py).
Both return hidden states; `compute_logits` applies the head and the final soft-cap.
Weights: transformers ties the encoder's text weights to the decoder's and the head to the
embedding unless the checkpoint's config says tie_word_embeddings=false, which unties all of
them; then the encoder pass runs its own copy (`encoder_*`) and the head is `lm_head`.
The model sees flattened tokens, absolute positions and an attention backend with
`attn.forward(layer_idx, q, k, v)` (diffusion_gemma_attention.py); never requests or masks.
The vision tower is not built: text-only serving ignores it (its weights are skipped on load).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fluxlab.models.diffusion_gemma.layers import GemmaAttention, GemmaDecoderLayer, GemmaMLP, GemmaRMSNorm
from fluxlab.kernels.invariant_matmul import linear, matmul, use_kernel


def check_text_config(text_config) -> None:
    """Refuse configs whose behaviour this model does not reproduce, naming the key."""
    if getattr(text_config, "use_bidirectional_attention", None) == "all":
        raise ValueError("diffusion_gemma: text_config.use_bidirectional_attention='all' (a bidirectional encoder) "
                         "is not supported; transformers 5.24's own generate() also fails on it")
    if text_config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"diffusion_gemma: text_config.hidden_activation={text_config.hidden_activation!r} "
                         "is not supported (only gelu_pytorch_tanh)")
    if text_config.attention_bias:
        raise ValueError("diffusion_gemma: text_config.attention_bias=true is not supported")
    if not text_config.num_experts or not text_config.top_k_experts or not text_config.moe_intermediate_size:
        raise ValueError("diffusion_gemma: text_config needs num_experts, top_k_experts and moe_intermediate_size "
                         "(every Gemma-4 layer of this model has routed experts)")


class SelfConditioning(nn.Module):
    """Gated MLP over the previous step's soft embeddings, added to the token embeddings, then an
    unscaled RMSNorm (transformers' DiffusionGemmaSelfConditioning)."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float):
        super().__init__()
        self.pre_norm = GemmaRMSNorm(hidden_size, eps)
        self.post_norm = GemmaRMSNorm(hidden_size, eps, with_scale=False)
        mlp = GemmaMLP(hidden_size, intermediate_size)
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, embeds: torch.Tensor, soft_embeds: torch.Tensor) -> torch.Tensor:
        h = self.pre_norm(soft_embeds)
        gate, up = linear(h, self.gate_proj.weight), linear(h, self.up_proj.weight)
        signal = linear(F.gelu(gate, approximate="tanh") * up, self.down_proj.weight)
        return self.post_norm(embeds + signal)


class DiffusionGemmaModel(nn.Module):
    def __init__(self, text_config, tied: bool = True):
        super().__init__()
        check_text_config(text_config)
        c = text_config
        self.config = c
        self.tied = tied
        self.layer_types = list(c.layer_types)
        self.sliding_window = c.sliding_window
        self.final_logit_softcapping = c.final_logit_softcapping
        self.embed_scale = c.hidden_size ** 0.5
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = self._text_layers(c)
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_conditioning = SelfConditioning(c.hidden_size, c.intermediate_size, c.rms_norm_eps)
        # untied checkpoints: the encoder's own text weights and a head of its own
        self.encoder_embed_tokens = None if tied else nn.Embedding(c.vocab_size, c.hidden_size)
        self.encoder_layers = None if tied else self._text_layers(c)
        self.encoder_norm = None if tied else GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if tied else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        for layer_type, inv_freq in rope_inv_freqs(c).items():
            self.register_buffer(f"{layer_type}_inv_freq", inv_freq, persistent=False)

    @staticmethod
    def _text_layers(c) -> nn.ModuleList:
        layers = []
        for i, layer_type in enumerate(c.layer_types):
            per_layer = c.per_layer_config[i]  # full-attention layers carry their own head_dim / KV heads
            layers.append(GemmaDecoderLayer(
                i, c.hidden_size, c.intermediate_size, c.num_attention_heads, per_layer.num_key_value_heads,
                per_layer.head_dim, layer_type == "sliding_attention", c.num_experts, c.top_k_experts,
                c.moe_intermediate_size, c.rms_norm_eps))
        return nn.ModuleList(layers)

    def fuse_projections_(self) -> "DiffusionGemmaModel":
        """Every attention's q/k/v and dense MLP's gate/up as one weight each (layers.fuse_linears): the
        CUDA half-precision path, where the batch-invariant matmul or the FP8 GEMM computes them. FP8
        layers fuse where every part is whole 128-row blocks (26B-A4B: q/k/v yes; gate/up, 2112 rows,
        no: those keep one shared activation quantization for two GEMMs)."""
        for module in self.modules():
            if isinstance(module, (GemmaAttention, GemmaMLP)):
                module.fuse_projections_()
        return self

    def dense_beside_experts_(self, max_tokens: int) -> "DiffusionGemmaModel":
        """Forwards of at most `max_tokens` tokens run each layer's dense MLP on a second CUDA stream
        beside its router and routed experts (0: never). Both read the same normed residual and meet in
        the closing norm, so the values are the one-stream forward's, bit for bit (same kernels, same
        inputs); what may change is time: at one canvas the experts stream weight bytes while the dense
        GEMMs want tensor cores (SGLang runs DeepSeek's shared experts beside the routed ones so). The
        CUDA half-precision path only (the fused feed-forward); a CUDA graph captures the fork and join.
        load_model turns it on up to loader.DENSE_BESIDE_EXPERTS_TOKENS (benchmarks/device/diffusion_gemma_overlap.py)."""
        device = self.embed_tokens.weight.device
        if max_tokens > 0 and device.type != "cuda":
            raise ValueError(f"dense_beside_experts_({max_tokens}): a second stream needs a CUDA device, not {device}")
        stream = torch.cuda.Stream(device) if max_tokens > 0 else None
        for layer in [*self.layers, *(self.encoder_layers or [])]:
            layer.side_stream, layer.side_max_tokens = stream, max_tokens
        return self

    @property
    def layer_is_sliding(self) -> list[bool]:
        return [t == "sliding_attention" for t in self.layer_types]

    def embed(self, ids: torch.Tensor, encoder: bool | torch.Tensor = False) -> torch.Tensor:
        """Scaled token embeddings; encoder: the pass (or a per-token mask), which matters untied."""
        w = self.embed_tokens.weight
        scale = torch.tensor(self.embed_scale, dtype=w.dtype)
        if self.encoder_embed_tokens is None or (not isinstance(encoder, torch.Tensor) and not encoder):
            return self.embed_tokens(ids) * scale
        if not isinstance(encoder, torch.Tensor):
            return self.encoder_embed_tokens(ids) * scale
        return torch.where(encoder[:, None], self.encoder_embed_tokens(ids), self.embed_tokens(ids)) * scale

    def soft_embed(self, logits: torch.Tensor) -> torch.Tensor:
        """Expected embedding under softmax(logits), scaled like token embeddings."""
        return self.soft_embed_probs(logits.softmax(dim=-1, dtype=torch.float32))

    def soft_embed_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """`soft_embed` from the fp32 softmax itself (the canvas step has it already)."""
        w = self.embed_tokens.weight
        p = probs.to(w.dtype)
        if use_kernel(p):  # [.., V] @ [V, H]: a 262144-long reduction, split by K alone (batch invariance)
            soft = matmul(p.reshape(-1, p.shape[-1]), w.t()).view(*p.shape[:-1], w.shape[1])
        else:
            soft = p @ w
        return soft * torch.tensor(self.embed_scale, dtype=w.dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for layer_type in set(self.layer_types):
            freqs = positions[:, None].float() * getattr(self, f"{layer_type}_inv_freq").float()
            emb = torch.cat((freqs, freqs), dim=-1)
            out[layer_type] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return out

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, attn, encoder: bool,
                static: bool = False) -> torch.Tensor:
        rope = self._rope(positions, h.dtype)
        twins = self.encoder_layers if self.encoder_layers is not None else [None] * len(self.layers)
        for layer, twin, layer_type in zip(self.layers, twins, self.layer_types):
            cos, sin = rope[layer_type]
            h = layer(h, cos, sin, attn, encoder, static, twin)
        if self.encoder_norm is None or (not isinstance(encoder, torch.Tensor) and not encoder):
            return self.norm(h)
        if not isinstance(encoder, torch.Tensor):
            return self.encoder_norm(h)
        return torch.where(encoder[:, None], self.encoder_norm(h), self.norm(h))

    def encode(self, ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        return self._layers(self.embed(ids, encoder=True), positions, attn, encoder=True)

    def denoise(self, canvas_ids: torch.Tensor, positions: torch.Tensor, attn,
                self_conditioning_logits: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.embed(canvas_ids)
        soft = (torch.zeros_like(embeds) if self_conditioning_logits is None
                else self.soft_embed(self_conditioning_logits))
        return self._layers(self.self_conditioning(embeds, soft), positions, attn, encoder=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn, is_canvas: torch.Tensor,
                soft_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Both passes in one forward (the engine's): encoder tokens (is_canvas False: a prompt
        chunk or a committed canvas) and canvas tokens, flattened. Every step but attention is per
        token, so a mixed batch computes what the two passes compute apart. `soft_embeds` [canvas
        tokens, H] is the self-conditioning input (`soft_embed` of the previous step; zeros at a
        canvas' first step; None: all zeros)."""
        h = self.embed(ids, ~is_canvas)
        canvas = is_canvas.nonzero().squeeze(-1)
        if canvas.numel():
            embeds = h[canvas]
            soft = torch.zeros_like(embeds) if soft_embeds is None else soft_embeds.to(embeds.dtype)
            h = h.index_copy(0, canvas, self.self_conditioning(embeds, soft))
        return self._layers(h, positions, attn, encoder=~is_canvas)

    def forward_canvas(self, ids: torch.Tensor, positions: torch.Tensor, attn, soft_embeds: torch.Tensor,
                       is_canvas: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` with static shapes and no host sync, so a CUDA graph can hold it
        (canvas_static.py): canvas tokens only (is_canvas None), or a mix where `soft_embeds`
        covers every token (its rows at encoder tokens are not read). The self-conditioning MLP
        runs on every token and only canvas tokens keep it; every op is per token, so the values
        are `forward`'s."""
        h = self.embed(ids) if is_canvas is None else self.embed(ids, ~is_canvas)
        conditioned = self.self_conditioning(h, soft_embeds)
        if is_canvas is None:
            return self._layers(conditioned, positions, attn, encoder=False, static=True)
        h = torch.where(is_canvas[:, None], conditioned, h)
        return self._layers(h, positions, attn, encoder=~is_canvas, static=True)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's raw logits in the model dtype (the canvas step soft-caps them itself)."""
        return linear(hidden, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head, then fp32 soft-capping cap * tanh(logits / cap), in place on the fp32 copy
        ([tokens, vocab]: 1 GiB a 256-token canvas at 262144 ids, so no extra copies)."""
        logits = self.head(hidden).float()
        cap = self.final_logit_softcapping
        return logits.div_(cap).tanh_().mul_(cap) if cap else logits


def rope_inv_freqs(text_config) -> dict[str, torch.Tensor]:
    """Inverse frequencies per layer type, from transformers' own RoPE init (default for sliding
    layers, proportional with zero frequencies on the unrotated dims for full-attention layers)."""
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextRotaryEmbedding

    rope = DiffusionGemmaTextRotaryEmbedding(text_config)
    for layer_type in set(text_config.layer_types):
        if rope.rope_type.get(layer_type) in ("dynamic", "longrope"):  # transformers rescales these per forward
            raise ValueError(f"diffusion_gemma: rope_parameters[{layer_type!r}].rope_type="
                             f"{rope.rope_type[layer_type]!r} changes with the sequence length; not supported")
        if getattr(rope, f"{layer_type}_attention_scaling") != 1.0:
            raise ValueError(f"diffusion_gemma: rope_parameters[{layer_type!r}] scales attention; not supported")
    return {t: getattr(rope, f"{t}_inv_freq").clone() for t in set(text_config.layer_types)}
