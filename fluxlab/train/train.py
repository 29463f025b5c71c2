"""Train the embedded model: `python -m fluxlab.train --out DIR [--steps N --seed S --device cuda]`.

A small LLaDA2-MoE (fluxlab's own model code) learns the synthetic task (fluxlab/train/task.py)
with the block-diffusion objective (objective.py). Block lengths are drawn from BLOCK_LENGTHS each
step so one model serves the decoders' defaults (64 for threshold, 32 for joint_threshold) and
sweeps. Routed experts are balanced the LLaDA2/DeepSeek-V3 way, without an auxiliary loss: after
each step every expert's `expert_bias` moves by BIAS_RATE toward equal load.

Writes a checkpoint folder the engine loads (config.json, model.safetensors in fp32, tokenizer
files) plus loss.jsonl and train_summary.json. Needs torch, safetensors and tokenizers only.
Seeded: the same arguments give the same tokenizer, initial weights, data order and noise; the
trained weights match up to the device's floating-point nondeterminism (CUDA's atomics).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

# The Triton inference kernels have no backward: training runs the torch paths of the same modules.
os.environ["FLUXLAB_FUSED_KERNELS"] = "0"

import torch  # noqa: E402

from fluxlab.models.llada2.model import LLaDA2MoeConfig  # noqa: E402
from fluxlab.train.objective import bd_loss  # noqa: E402
from fluxlab.train.task import Problem, problems, held_out_set  # noqa: E402

BLOCK_LENGTHS = (16, 32, 64)
SEQ_LEN = 96  # prompt + reply + EOS padding: every task problem fits (the longest is 66 tokens)
BIAS_RATE = 1e-2
PROBE_STEPS = 20  # --time-budget-s: steps timed before the schedule's length is fixed

# The architecture of the published LLaDA2 checkpoints at toy size: layer 0 dense, then MoE layers
# with 16 sigmoid-routed experts in 4 groups (top-4 of 2 groups) plus a shared expert, GQA 4/2,
# QK-norm, partial RoPE on half of each head.
SHAPES = {
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rotary_dim": 32,
    "partial_rotary_factor": 0.5, "num_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    "num_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "rope_theta": 10000,
    "max_position_embeddings": 4096, "max_window_layers": 4, "torch_dtype": "float32",
}


def model_config(special_ids: dict[str, int]) -> dict:
    from fluxlab.models.llada2.presets import preset_config

    cfg = preset_config("tiny")  # the published config.json keys; the shapes are replaced below
    cfg.update(SHAPES)
    cfg["vocab_size"] = max(special_ids.values()) + 1
    cfg["pad_token_id"] = special_ids["<|endoftext|>"]
    return cfg


def encode(tok, items: list[Problem], eos_id: int, trim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, SEQ_LEN] (chat prompt, reply, EOS to the end) and the reply positions [B, SEQ_LEN]."""
    from fluxlab.engine.chat import render_chat

    prompts = tok.encode_batch([render_chat(None, p.messages()) for p in items])
    replies = tok.encode_batch([p.reply for p in items])
    rows, starts = [], []
    for p, r in zip(prompts, replies):
        seq = p.ids + r.ids
        if len(seq) >= SEQ_LEN:
            raise ValueError(f"a problem of {len(seq)} tokens does not fit SEQ_LEN={SEQ_LEN}")
        rows.append(seq + [eos_id] * (SEQ_LEN - len(seq)))
        starts.append(len(p.ids))
    ids = torch.tensor(rows, dtype=torch.long)
    reply = torch.arange(SEQ_LEN)[None, :] >= torch.tensor(starts)[:, None]
    if trim:  # CPU: drop the EOS-only tail columns past the batch's longest row (+ a block of 16)
        keep = min(SEQ_LEN, -(-max(len(p.ids) + len(r.ids) for p, r in zip(prompts, replies)) // 16) * 16 + 16)
        ids, reply = ids[:, :keep], reply[:, :keep]
    return ids, reply


def batches(tok, seed: int, batch_size: int, eos_id: int, trim: bool, prefetch: int = 8):
    """Encoded training batches in a fixed order, made on a thread ahead of the GPU."""
    import queue
    import threading

    out: queue.Queue = queue.Queue(maxsize=prefetch)

    def produce():
        data = problems(seed, "train")
        while True:
            out.put(encode(tok, [next(data) for _ in range(batch_size)], eos_id, trim))

    threading.Thread(target=produce, daemon=True).start()
    while True:
        yield out.get()


def build_model(config: dict, seed: int, device: torch.device, init_from: str | None = None):
    """Random weights from `seed` (std 0.02, unit norms), or a checkpoint folder's to continue from."""
    from fluxlab.engine.layers.moe import StackedExperts
    from fluxlab.models.llada2.loader import build_random_model, load_model

    if init_from:
        model, loaded = load_model(init_from, torch.float32, device, progress=False)
        if loaded.to_dict() != LLaDA2MoeConfig.from_dict(config).to_dict():
            raise ValueError(f"--init-from {init_from}: its config.json is not this script's model")
    else:
        model, _ = build_random_model(config, torch.float32, device, seed=seed)
    for module in model.modules():
        if isinstance(module, StackedExperts):
            module.backend = "torch"  # the differentiable per-expert loop
    for name, param in model.named_parameters():
        param.requires_grad_(not name.endswith("expert_bias"))
    return model.train()


def expert_load_hooks(model) -> list[torch.Tensor]:
    """One tensor per MoE layer, accumulating how often each expert was chosen in a step."""
    from fluxlab.engine.layers.moe import MoEGate

    loads = []
    for module in model.modules():
        if isinstance(module, MoEGate):
            load = torch.zeros(module.expert_bias.numel(), device=module.expert_bias.device)

            def hook(mod, args, output, load=load):
                idx = output[0].reshape(-1)  # index_add_, not bincount: no host sync
                load.index_add_(0, idx, torch.ones(idx.numel(), device=load.device))

            module.register_forward_hook(hook)
            loads.append((module, load))
    return loads


def balance_experts(loads) -> torch.Tensor:
    """Aux-loss-free balancing: underloaded experts' bias up, overloaded down; -> worst max/mean load."""
    worst = torch.zeros(())
    for gate, load in loads:
        mean = load.mean()
        gate.expert_bias.data += BIAS_RATE * torch.sign(mean - load)
        worst = torch.maximum(worst.to(load.device), load.max() / mean.clamp(min=1))
        load.zero_()
    return worst


def export_tensors(model) -> dict[str, torch.Tensor]:
    """Official checkpoint names (engine/loader.py's layout) -> fp32 tensors, experts unstacked."""
    from fluxlab.models.llada2.layout import checkpoint_layout

    params = dict(model.named_parameters())
    out = {}
    for name, slot in checkpoint_layout(model.config).items():
        t = params[slot.param].detach()
        # a copy: some parameters view one shared tensor (layers/linear.StackedRows), which safetensors refuses
        out[name] = (t if slot.index is None else t[slot.index]).to("cpu", torch.float32, copy=True).contiguous()
    return out


def write_model_dir(out: Path, model, config: dict, tokenizer_json: str, special_ids: dict[str, int]) -> None:
    from safetensors.torch import save_file

    from fluxlab.checkpoint import _dump, tokenizer_files

    out.mkdir(parents=True, exist_ok=True)
    files = tokenizer_files(special_ids, config["max_position_embeddings"], tokenizer_json)
    files["config.json"] = _dump(config)
    files["generation_config.json"] = _dump({"eos_token_id": special_ids["<|endoftext|>"],
                                            "pad_token_id": special_ids["<|endoftext|>"]})
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    save_file(export_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def evaluate(model, tok, items: list[Problem], mask_id: int, eos_id: int, block_length: int = 64) -> float:
    """Held-out accuracy with the reference decoder at the default threshold (0.9)."""
    from fluxlab.bench.scoring import arith_correct
    from fluxlab.engine.chat import render_chat
    from fluxlab.models.llada2.reference import reference_generate

    model.eval()
    right = 0
    for p in items:
        ids = tok.encode(render_chat(None, p.messages())).ids
        out = reference_generate(model, ids, mask_id=mask_id, eos_id=eos_id, block_length=block_length,
                                 max_new_tokens=64, threshold=0.9)
        right += arith_correct(tok.decode(out.token_ids), str(p.answer))
    model.train()
    return right / len(items)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:  # PROBE_STEPS <= warmup: see --time-budget-s
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10% of peak


def train(args) -> dict:
    from tokenizers import Tokenizer

    from fluxlab.train.tokenizer import train_task_tokenizer

    if args.time_budget_s and args.warmup < PROBE_STEPS:
        raise ValueError(f"--time-budget-s needs --warmup >= {PROBE_STEPS} (the probe steps must be warm-up)")
    out = Path(args.out)
    device = torch.device(args.device)
    if args.bf16 is None:
        args.bf16 = device.type == "cuda"
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tokenizer_json, special_ids = train_task_tokenizer(args.seed)
    tok = Tokenizer.from_str(tokenizer_json)
    init_tokenizer = Path(args.init_from or ".") / "tokenizer.json"
    if args.init_from and json.loads(init_tokenizer.read_text()) != json.loads(tokenizer_json):
        raise ValueError(f"--init-from {args.init_from}: its tokenizer is not the one --seed {args.seed} trains")
    mask_id, eos_id = special_ids["<|mask|>"], special_ids["<|endoftext|>"]
    num_ordinary = min(special_ids.values())  # the learned vocab; specials follow it
    config = model_config(special_ids)
    model = build_model(config, args.seed, device, args.init_from)
    loads = expert_load_hooks(model)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98),
                            fused=device.type == "cuda")
    data_seed = args.seed if args.data_seed is None else args.data_seed
    data = batches(tok, data_seed, args.batch_size, eos_id, trim=device.type == "cpu")
    block_rng = random.Random(args.seed + 1)
    noise_gen = torch.Generator(device=device)
    noise_gen.manual_seed(args.seed + 2)
    held_out = held_out_set(args.eval_problems, seed=args.seed + 3)
    stop_after = args.stop_after or args.steps
    log_path = out / "loss.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    start = time.time()
    window: list[torch.Tensor] = []
    step, probe_from = -1, 0.0
    while step + 1 < stop_after:
        step += 1
        ids, reply = next(data)
        ids, reply = ids.to(device, non_blocking=True), reply.to(device, non_blocking=True)
        block_length = block_rng.choice(BLOCK_LENGTHS)
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss, stats = bd_loss(model, ids, reply, mask_id, num_ordinary, block_length, noise_gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = balance_experts(loads)
        if args.time_budget_s and step + 1 in (5, PROBE_STEPS) and device.type == "cuda":
            torch.cuda.synchronize()  # the probe times finished steps, not queued ones
        if step + 1 == 5:
            probe_from = time.time() - start
        window.append(loss.detach())
        if (step + 1) % args.log_every == 0 or step + 1 == stop_after:
            row = {"step": step + 1, "loss": float(torch.stack(window).mean()), "lr": lr,
                   "block_length": block_length, "acc_masked": float(stats["acc_masked"]),
                   "acc_corrected": float(stats["acc_corrected"]),
                   "expert_load_max_over_mean": float(imbalance),
                   "elapsed_s": round(time.time() - start, 1)}
            window = []
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
            log.flush()
        if args.time_budget_s and step + 1 == PROBE_STEPS:
            # The LR schedule's length from the measured speed. The probe steps are all warm-up,
            # whose LR does not depend on --steps: `--steps N` from the start retraces this run.
            elapsed = time.time() - start
            per_step = (elapsed - probe_from) / (PROBE_STEPS - 5)  # the first 5 include CUDA's warm-up
            args.steps = stop_after = PROBE_STEPS + max(1, int((args.time_budget_s - elapsed) / per_step))
            print(f"--time-budget-s {args.time_budget_s}: {per_step * 1000:.0f} ms/step -> --steps {args.steps}",
                  flush=True)
        if args.time_limit_s and time.time() - start > args.time_limit_s:
            print(f"time limit {args.time_limit_s}s reached after {step + 1} steps; reproduce with "
                  f"--steps {args.steps} --stop-after {step + 1}", flush=True)
            break
    log.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - start
    write_model_dir(out, model.eval(), config, tokenizer_json, special_ids)
    accuracy = evaluate(model, tok, held_out, mask_id, eos_id) if args.eval_problems else None
    summary = {"command": "python -m fluxlab.train " + " ".join(sys.argv[1:]), "seed": args.seed,
               "init_from": args.init_from, "data_seed": data_seed,
               "steps": args.steps, "steps_run": step + 1, "batch_size": args.batch_size, "lr": args.lr,
               "bf16": args.bf16,
               "train_seconds": round(train_s, 1), "device": str(device),
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "parameters": sum(p.numel() for p in model.parameters()),
               "heldout_accuracy_reference_threshold_0.9": accuracy, "eval_problems": args.eval_problems}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    return summary


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fluxlab.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint folder to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-from", default=None, help="continue from this checkpoint folder's weights")
    ap.add_argument("--data-seed", type=int, default=None, help="seed of the problem stream (default: --seed)")
    ap.add_argument("--steps", type=int, default=3000, help="length of the LR schedule")
    ap.add_argument("--stop-after", type=int, default=None, help="stop early at this step (default: --steps)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 autocast, the weights and optimizer staying fp32 (default: on CUDA)")
    ap.add_argument("--eval-problems", type=int, default=100, help="held-out problems scored at the end")
    ap.add_argument("--time-limit-s", type=float, default=None, help="stop (and save) after this many seconds")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="set --steps from the speed of the first steps so training takes about this long")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
