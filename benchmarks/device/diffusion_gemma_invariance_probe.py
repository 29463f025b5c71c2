"""Which ops of a Diffusion-Gemma canvas step are batch-invariant on this GPU (issue 36.2).

For each op at 26B-A4B shapes in bf16: the first canvas' rows (256 tokens) computed alone, then
inside 8 and 64 canvases; "same" = the same bits. Linears go through F.linear (cuBLAS); attention
through sdpa with the masks the canvas paths use, alone vs beside rows with longer prefixes (more
padded keys), in the current layout [prefix keys (padded), canvas] and canvas-first. Prints a table.
"""
import torch
import torch.nn.functional as F

dev, bf = torch.device("cuda"), torch.bfloat16
torch.manual_seed(0)
L = 256


def linear_rows(k: int, n: int, rows=(1, 8, 64)):
    w = torch.randn(n, k, device=dev, dtype=bf) * k ** -0.5
    x = torch.randn(max(rows) * L, k, device=dev, dtype=bf)
    if k > 100000:  # soft_embed: probabilities
        x = torch.softmax(x.float(), -1).to(bf)
    outs = [F.linear(x[:r * L], w)[:L] for r in rows]
    return [torch.equal(outs[0], o) for o in outs[1:]]


def attention_rows(heads: int, kv: int, d: int, canvas_first: bool, rows=(1, 8, 64), prefix=256):
    """Row 0 (prefix `prefix` keys) alone (keys padded to its own prefix) vs in batches padded to 4 pages."""
    q = torch.randn(max(rows), L, heads, d, device=dev, dtype=bf)
    pk = torch.randn(max(rows), 4 * L, kv, d, device=dev, dtype=bf)
    pv = torch.randn_like(pk)
    ck, cv = torch.randn(max(rows), L, kv, d, device=dev, dtype=bf), torch.randn(max(rows), L, kv, d, device=dev, dtype=bf)
    outs = []
    for r in rows:
        width = prefix if r == 1 else 4 * L
        keys_p, vals_p = pk[:r, :width], pv[:r, :width]
        valid = torch.arange(width, device=dev)[None, :] < torch.full((r, 1), prefix, device=dev)
        valid[1:] = True  # other rows use every key
        vis = torch.cat([torch.ones(r, L, dtype=torch.bool, device=dev), valid], 1) if canvas_first else \
            torch.cat([valid, torch.ones(r, L, dtype=torch.bool, device=dev)], 1)
        keys = torch.cat([ck[:r], keys_p], 1) if canvas_first else torch.cat([keys_p, ck[:r]], 1)
        vals = torch.cat([cv[:r], vals_p], 1) if canvas_first else torch.cat([vals_p, cv[:r]], 1)
        mask = vis[:, None, None, :].expand(r, 1, L, vis.shape[1])
        o = F.scaled_dot_product_attention(q[:r].transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                           attn_mask=mask, scale=1.0, enable_gqa=True)
        outs.append(o[0])
    return [torch.equal(outs[0], o) for o in outs[1:]]


table = []
for name, k, n in [("q sliding", 2816, 4096), ("k/v sliding", 2816, 2048), ("o sliding", 4096, 2816),
                   ("q full", 2816, 8192), ("k full", 2816, 1024), ("o full", 8192, 2816),
                   ("mlp gate/up", 2816, 2112), ("mlp down", 2112, 2816), ("router", 2816, 128),
                   ("lm_head", 2816, 262144), ("soft_embed", 262144, 2816)]:
    rows = (1, 4) if n > 100000 or k > 100000 else (1, 8, 64)
    table.append((f"linear {name} {k}->{n}", rows, linear_rows(k, n, rows)))
for name, h, kv, d in [("sliding", 16, 8, 256), ("full", 16, 2, 512)]:
    for first in (False, True):
        try:
            res = attention_rows(h, kv, d, first)
        except Exception as err:  # noqa: BLE001
            res = [f"error {type(err).__name__}: {str(err)[:80]}"]
        table.append((f"sdpa {name} d={d} {'canvas-first' if first else 'prefix-first'}", (1, 8, 64), res))
print("\nop | batches | same bits as alone")
for name, rows, res in table:
    print(f"{name} | {rows} | {res}")
