"""Where a Diffusion-Gemma denoising step's GPU time goes (26B-A4B shapes, random bf16, canvas 256).

python3 benchmarks/device/diffusion_gemma_profile.py 1,16 [none|fp8]: for each batch, the static step (the
kernels the denoiser graph holds, called as is) under torch.profiler, 3 steps after warm-up; prints
the top kernels by CUDA time, per step.
"""
import sys

import torch

from fluxlab.bench.canvas import _engine, step_batches

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,16").split(",")]
quantization = sys.argv[2] if len(sys.argv) > 2 else "none"  # fp8: model.quantization=fp8
engine = _engine("diffusion_gemma_26b_a4b", max(batches), 5, False, [], quantization)
engine.runner.enable_denoise_graphs(batches, capture=False)
for b in batches:
    decode, _, _ = step_batches(engine, b, 256)
    with torch.inference_mode():
        for _ in range(2):
            engine.runner.run(decode)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.runner.run(decode)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 3e3
    print(f"\n== batch {b}: {total:.2f} ms of kernels a step ==")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:24]:
        print(f"{e.self_device_time_total / 3e3:8.3f} ms  x{e.count // 3:<5} {e.key[:110]}")
