"""SDAR / TraDo (`model_type: sdar` dense, `sdar_moe` MoE): Qwen3 run block-causally, written for the engine.

The published modeling code (JetLM's `modeling_sdar.py`, TraDo's copy in Gen-Verse/dLLM-RL) is Qwen3 with one
change that matters here: attention takes the caller's mask (block-causal, blocks aligned to position 0) instead
of a causal one, and K/V reach the cache only on forwards called with `store_kv=True`. Per layer: RMSNorm ->
q/k/v projections -> per-head RMSNorm of q and k (Qwen3's QK-norm) -> full-width rotate-half RoPE -> attention ->
o_proj -> residual; RMSNorm -> SwiGLU MLP (or the Qwen3-MoE block: a softmax router over num_experts, the top
num_experts_per_tok renormalised when norm_topk_prob) -> residual. Final RMSNorm, lm_head (tied to the embedding
when tie_word_embeddings). Each position predicts its own token (no shift).

Like fluxlab's LLaDA2 model, it sees flattened tokens, their absolute positions and an attention backend `attn`
(`attn.forward(layer, q, k, v)`, or for a paged backend `kv_rows` + `attend`); never requests or masks. Q, K and
V are one fused projection here (the checkpoint's q_proj | k_proj | v_proj rows, stacked by the loader), so one
GEMM and, on CUDA, the fused QK-norm + RoPE kernel serve it as they serve LLaDA2.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fluxlab.engine.layers.attention import PagedBackend
from fluxlab.engine.layers.linear import (ColumnParallelLinear, ParallelDims, ParallelLMHead, QKVParallelLinear,
                                          RowParallelLinear, VocabParallelEmbedding, get_parallel_dims)
from fluxlab.engine.layers.moe import StackedExperts
from fluxlab.engine.layers.norm import RMSNorm, rms_norm, use_fused
from fluxlab.engine.layers.rotary import PartialRotary, apply_partial_rotary
from fluxlab.models.config_json import ConfigJson

MODEL_TYPES = ("sdar", "sdar_moe")


@dataclass
class SDARConfig(ConfigJson):
    """config.json of an SDAR/TraDo checkpoint (the published SDARConfig's fields; the MoE fields are
    Qwen3-MoE's, as SDAR-30B-A3B's config carries them). num_experts = 0: dense."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_sliding_window: bool = False
    # MoE (Qwen3-MoE fields; SDAR-30B-A3B)
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    model_type: str = "sdar"
    extra: dict = field(default_factory=dict, repr=False)  # unknown config.json keys, kept verbatim

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not SDAR's ({', '.join(MODEL_TYPES)})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} unsupported (SDAR uses silu)")
        if self.attention_bias:
            raise ValueError("attention_bias=true is unsupported (no published SDAR checkpoint has biases)")
        if self.rope_scaling:
            raise ValueError(f"rope_scaling {self.rope_scaling!r} is unsupported (published SDAR configs: null)")
        if self.use_sliding_window:
            raise ValueError("use_sliding_window=true is unsupported (published SDAR configs: false)")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                             f"{self.num_experts}]")

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE's rule: an expert layer unless listed in mlp_only_layers, every decoder_sparse_step-th."""
        return (bool(self.num_experts) and i not in self.mlp_only_layers
                and (i + 1) % max(self.decoder_sparse_step, 1) == 0)


def check_parallel(c: SDARConfig, tp_size: int, ep_size: int) -> None:
    if tp_size != 1 or ep_size != 1:
        raise ValueError(f"parallel.tp_size={tp_size}, ep_size={ep_size}: SDAR runs on one GPU for now "
                         "(tensor and expert parallelism are not wired for this family)")


class SDARMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype=None, device=None):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, dtype=dtype, device=device)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, dtype=dtype, device=device)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if use_fused(gate):
            from fluxlab.kernels.swiglu import silu_mul

            return self.down_proj(silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class SDARSparseMoeBlock(nn.Module):
    """Qwen3-MoE block: router logits in the model dtype (an nn.Linear there), softmax over all experts in
    fp32, the top num_experts_per_tok (renormalised when norm_topk_prob), weights cast to the model dtype,
    then the weighted sum of the chosen SwiGLU experts (StackedExperts; combined in fp32)."""

    def __init__(self, c: SDARConfig, dtype=None, device=None):
        super().__init__()
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, dtype=dtype, device=device),
                                        requires_grad=False)
        self.experts = StackedExperts(c.num_experts, c.hidden_size, c.moe_intermediate_size, dtype, device)

    def route(self, x):
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weight, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return idx, weight.to(x.dtype)

    def forward(self, x):
        idx, weight = self.route(x)
        return self.experts(x, idx, weight)


class SDARAttention(nn.Module):
    def __init__(self, c: SDARConfig, layer_idx: int, dtype=None, device=None):
        super().__init__()
        self.layer_idx, self.head_dim, self.eps = layer_idx, c.head_dim, c.rms_norm_eps
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                          dtype=dtype, device=device)
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size, dtype=dtype,
                                        device=device)

    def forward(self, x, cos_sin, attn):
        T = x.shape[0]
        qkv = self.qkv_proj(x).view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        if use_fused(qkv):  # QK-norm + RoPE in one Triton launch; K/V straight to the paged cache
            from fluxlab.kernels.fused_norm import qk_norm_rope, qk_norm_rope_to_cache

            args = (qkv, None, self.q_norm.weight, self.k_norm.weight, self.eps, cos[:, 0], sin[:, 0],
                    self.num_heads, self.num_kv_heads, self.head_dim, cos.shape[-1])
            if isinstance(attn, PagedBackend):
                o = attn.attend(self.layer_idx, qk_norm_rope_to_cache(*args, *attn.kv_rows(self.layer_idx)))
            else:
                o = attn.forward(self.layer_idx, *qk_norm_rope(*args))
            return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = self.q_norm(q), self.k_norm(k)  # per head, before RoPE (Qwen3)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        o = attn.forward(self.layer_idx, q.contiguous(), k.contiguous(), v.contiguous())
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class SDARDecoderLayer(nn.Module):
    def __init__(self, c: SDARConfig, layer_idx: int, dtype=None, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = SDARAttention(c, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = (SDARSparseMoeBlock(c, dtype, device) if c.is_moe_layer(layer_idx)
                    else SDARMLP(c.hidden_size, c.intermediate_size, dtype, device))

    def forward(self, x, cos_sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class SDARModel(nn.Module):
    """The engine-facing model (same surface as fluxlab's LLaDA2 model): forward -> hidden states,
    compute_logits / compute_greedy_stats -> the head."""

    def __init__(self, config: SDARConfig, dtype=torch.bfloat16, device=None, dims: ParallelDims | None = None):
        super().__init__()
        c = self.config = config
        dims = self.dims = dims or get_parallel_dims()
        check_parallel(c, dims.tp_size, dims.ep_size)
        self.dtype = dtype
        self.dispatch = None  # no data-parallel attention
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.rotary_emb = PartialRotary(c.head_dim, c.head_dim, c.rope_theta, c.max_position_embeddings).to(device)
        self.layers = nn.ModuleList(SDARDecoderLayer(c, i, dtype, device) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        if c.tie_word_embeddings:  # one tensor, read by the embedding and the head
            self.lm_head.weight = self.embed_tokens.weight
        self.num_local_heads, self.num_local_kv_heads = c.num_attention_heads, c.num_key_value_heads

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids/positions [T] (flattened batch) -> hidden [T, hidden] before the final norm."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)
        cos_sin = (cos[:, None, :], sin[:, None, :])
        for layer in self.layers:
            x = layer(x, cos_sin, attn)
        return x

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        return self.lm_head.logits(rms_norm(hidden, self.norm.weight, self.norm.eps), fp32)

    @torch.no_grad()
    def compute_greedy_stats(self, hidden: torch.Tensor, fp32: bool = True):
        return self.lm_head.greedy_stats(rms_norm(hidden, self.norm.weight, self.norm.eps), fp32)
