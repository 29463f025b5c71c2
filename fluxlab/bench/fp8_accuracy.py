"""FP8 against bf16 on the embedded model's held-out problems (issue 38 item 3).

`python -m fluxlab.bench.fp8_accuracy [--num N] [--device cpu|cuda] [--out FILE.json]` loads
fluxlab/assets/arith_llada2 twice, in bf16 and quantized to FP8 at load (`quantize_model_`), runs the
reference generate (fluxlab/models/llada2/reference.py: threshold decoder, threshold 0.9, block 32, the
defaults the bench uses) on the first N of the 128 held-out problems with both, and prints the
right answers of each and the token agreement: the share of bf16's output positions where the FP8
run wrote the same token (a length difference counts as disagreement). On CPU the FP8 layers run
the dequantize -> matmul reference, on CUDA the Triton kernels.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(positions equal, positions compared) over the longer of the two outputs."""
    same = sum(x == y for x, y in zip(a, b))
    return same, max(len(a), len(b), 1)


def run(num: int = 128, device: str = "cpu", dtype: str = "bfloat16") -> dict:
    from tokenizers import Tokenizer

    from fluxlab.bench.scoring import arith_correct
    from fluxlab.config.paths import ASSETS_DIR
    from fluxlab.engine.chat import render_chat
    from fluxlab.engine.layers.quantization import quantize_model_
    from fluxlab.models.llada2.loader import load_model
    from fluxlab.models.llada2.reference import reference_generate
    from fluxlab.models.llada2.special_ids import special_token_ids

    model_dir = ASSETS_DIR / "arith_llada2"
    prompts = [json.loads(line) for line in (ASSETS_DIR / "arith_test.jsonl").read_text().splitlines()][:num]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    mask_id, eos_id, _ = special_token_ids(model_dir)
    torch_dtype = getattr(torch, dtype)
    models = {"bf16" if dtype == "bfloat16" else dtype: load_model(model_dir, torch_dtype, device, progress=False)[0],
              "fp8": quantize_model_(load_model(model_dir, torch_dtype, device, progress=False)[0])}
    outputs, right, seconds = {}, {}, {}
    for name, model in models.items():
        t0 = time.perf_counter()
        outputs[name] = []
        for p in prompts:
            ids = tok.encode(render_chat(None, p["messages"])).ids
            out = reference_generate(model, ids, mask_id=mask_id, eos_id=eos_id, block_length=32,
                                     max_new_tokens=p.get("max_tokens", 64))
            outputs[name].append(list(out.token_ids))
        seconds[name] = time.perf_counter() - t0
        right[name] = sum(arith_correct(tok.decode(o), p["metadata"]["answer"])
                          for o, p in zip(outputs[name], prompts))
    base, = (n for n in models if n != "fp8")
    pairs = [agreement(a, b) for a, b in zip(outputs[base], outputs["fp8"])]
    same, total = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return dict(problems=len(prompts), device=device, right={k: int(v) for k, v in right.items()},
                token_agreement=same / total, tokens_compared=total, identical_outputs=sum(a == b for a, b in zip(
                    outputs[base], outputs["fp8"])), seconds=seconds)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = run(args.num, args.device, args.dtype)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    print("\n| weights | right of {0} | token agreement with bf16 |\n|---|---|---|".format(result["problems"]))
    for name, r in result["right"].items():
        agree = "1" if name != "fp8" else f"{result['token_agreement']:.4f}"
        print(f"| {name} | {r} | {agree} |")


if __name__ == "__main__":
    main()
