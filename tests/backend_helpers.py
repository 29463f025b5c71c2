"""An attention backend's tokens beside sdpa's through the engine (tiny model, CPU, fp32)."""
from __future__ import annotations


def sdpa_and_backend_tokens(ckpt, backend: str, max_model_len: int, max_new_tokens: int):
    """(sdpa tokens, `backend` tokens, the backend's runner) of four prompts of 20-107 tokens:
    prefill chunks, decode and commit + decode rows in batches of one to four."""
    from fluxlab.engine.request import SamplingParams
    from fluxlab.llm import LLM

    llm = LLM(overrides=[f"model.path={ckpt}", "model=tiny_llada2", "engine.device=cpu", "engine.dtype=float32",
                         "decoding.block_length=32", f"model.max_model_len={max_model_len}",
                         "scheduler.max_num_seqs=4", "scheduler.enable_prefix_cache=false"])
    text = "Janet has 16 eggs and sells the rest at the market for two dollars each. " * 8
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    prompts = [ids[:20 + 29 * i] for i in range(4)]
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    want = [r.token_ids for r in llm.generate(prompts, params)]
    llm.engine.runner = runner = llm.engine.make_runner(backend)
    return want, [r.token_ids for r in llm.generate(prompts, params)], runner
