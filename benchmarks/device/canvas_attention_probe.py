"""Which canvas attention is wrong inside the engine, layer by layer: the Triton kernel and torch sdpa
against fp64 math on the same inputs, for every attention call of a few engine steps (prefill chunks,
commits, denoising). `python benchmarks/device/canvas_attention_probe.py [dtype...]` on a CUDA machine;
the checkpoint is tests/test_gpu_diffusion_gemma_invariance.py's (canvas 256, window 512, 6 layers).
Prints, per dtype, the worst relative error (norm over a row's tokens) of each path by layer kind and
call kind, and the worst rows. The engine keeps sdpa's output (the default path)."""
from __future__ import annotations

import collections
import os
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))

from fluxlab.models.diffusion_gemma import paged_attention as pa  # noqa: E402


def fp64_reference(meta, sliding, q, k, v, cache_k, cache_v):
    """The torch path's gathers and masks, in fp64 math, on copies of the pools."""
    slots = meta.key_slots[sliding]
    cache_k, cache_v = cache_k.clone(), cache_v.clone()
    if sliding:
        fresh = (meta.fresh_keys >= 0)[..., None, None]
        index = meta.fresh_keys.clamp(min=0)
        prefix_k, prefix_v = torch.where(fresh, k[index], cache_k[slots]), torch.where(fresh, v[index], cache_v[slots])
    else:
        if meta.full_write_slots.numel():
            cache_k[meta.full_write_slots] = k[meta.full_write_tokens]
            cache_v[meta.full_write_slots] = v[meta.full_write_tokens]
        prefix_k, prefix_v = cache_k[slots], cache_v[slots]
    keys = torch.cat([k[meta.canvas_gather], prefix_k], dim=1).double()
    values = torch.cat([v[meta.canvas_gather], prefix_v], dim=1).double()
    queries = q[meta.query_gather].double()  # [R, Q, H, D]
    group = q.shape[1] // k.shape[1]
    keys, values = keys.repeat_interleave(group, 2), values.repeat_interleave(group, 2)
    scores = torch.einsum("rqhd,rkhd->rhqk", queries, keys)
    scores = scores.masked_fill(~meta.masks[sliding], float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    out = torch.einsum("rhqk,rkhd->rqhd", probs, values)
    return out.reshape(-1, q.shape[1], q.shape[2])[meta.query_scatter], meta.geometry[sliding]


RECORDS = []
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")  # cpu: a check of this script under TRITON_INTERPRET=1


def probing_forward(original):
    def forward(self, layer_idx, q, k, v):
        meta = self.meta
        sliding = self.layer_is_sliding[layer_idx]
        cache_k, cache_v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        before = cache_k.clone(), cache_v.clone()
        want, geometry = fp64_reference(meta, sliding, q, k, v, cache_k, cache_v)
        got_kernel = self._kernel_forward(meta, sliding, q, k, v, cache_k, cache_v)
        after_kernel = cache_k.clone()
        cache_k.copy_(before[0]), cache_v.copy_(before[1])
        got_sdpa = original(self, layer_idx, q, k, v)
        same_writes = torch.equal(after_kernel, cache_k)
        num_keys, num_encoder, num_queries, first = geometry.tolist()
        # the flat tokens of row r: query_gather[r, :num_queries[r]]
        for r in range(len(num_keys)):
            tokens = meta.query_gather[r, :num_queries[r]]
            if not len(tokens):
                continue
            w = want[tokens]
            errs = [((g[tokens].double() - w).norm() / w.norm().clamp(min=1e-30)).item() for g in (got_kernel, got_sdpa)]
            kind = "canvas" if num_queries[r] > num_encoder[r] else "chunk"
            if num_encoder[r] and num_queries[r] > num_encoder[r]:
                kind = "commit+canvas"
            RECORDS.append(dict(layer=layer_idx, sliding=sliding, kind=kind, K=num_keys[r], E=num_encoder[r],
                                Q=num_queries[r], first=first[r], kernel=errs[0], sdpa=errs[1], writes=same_writes))
        return got_sdpa
    return forward


def main(dtypes):
    from test_canvas_attention import CANVAS, _requests
    from test_diffusion_gemma_shapes import write_checkpoint
    from test_gpu_diffusion_gemma_invariance import _shape

    from fluxlab.llm import LLM

    path = write_checkpoint(_shape(), pathlib.Path(tempfile.mkdtemp()) / "dg")
    pa.PagedCanvasAttention.forward = probing_forward(pa.PagedCanvasAttention.forward)
    for dtype in dtypes:
        RECORDS.clear()
        llm = LLM(overrides=[
            "model=tiny_diffusion_gemma", f"model.path={path}", "model.preset=null", f"decoding.canvas_length={CANVAS}",
            f"model.max_model_len={8 * CANVAS}", f"model.max_new_tokens={2 * CANVAS}", f"engine.dtype={dtype}",
            f"engine.device={DEVICE}", "scheduler=paged", "scheduler.max_num_seqs=8",
            f"scheduler.max_scheduled_tokens={8 * 2 * CANVAS}", "scheduler.num_device_pages=96",
            "scheduler.enable_prefix_cache=false", "attention=sdpa"])
        for prompt, params in _requests(4):
            llm.engine.add_request(prompt, params)
        with torch.inference_mode():
            for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 12):
                llm.engine.step()
        llm.shutdown()
        worst = collections.defaultdict(lambda: [0.0, 0.0, 0, True])
        for rec in RECORDS:
            w = worst[rec["sliding"], rec["kind"]]
            w[0], w[1] = max(w[0], rec["kernel"]), max(w[1], rec["sdpa"])
            w[2] += 1
            w[3] &= rec["writes"]
        print(f"== {dtype}: {len(RECORDS)} row-calls; worst rel err vs fp64 math")
        print("| layer | call | rows | kernel | sdpa | same cache writes |")
        for (sliding, kind), (ek, es, n, same) in sorted(worst.items()):
            print(f"| {'sliding' if sliding else 'full'} | {kind} | {n} | {ek:.2e} | {es:.2e} | {same} |")
        for name in ("kernel", "sdpa"):
            bad = sorted(RECORDS, key=lambda rec: -rec[name])[:4]
            print(f"worst {name} rows:", [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in b.items()}
                                          for b in bad])


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["float32", "bfloat16"])
