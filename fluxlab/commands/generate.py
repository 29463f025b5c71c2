from omegaconf import DictConfig

from fluxlab.commands._app import hydra_app, validated


def _generate(cfg: DictConfig) -> None:
    cfg = validated(cfg)
    from fluxlab.llm import LLM

    llm = LLM.from_config(cfg)
    try:
        prompt = [{"role": "user", "content": cfg.prompt}] if cfg.chat else cfg.prompt
        result = llm.generate([prompt])[0]
    finally:
        llm.shutdown()
    print(result.text)
    stats = result.stats
    print(f"\n[{result.finish_reason}] {len(result.token_ids)} tokens, {stats.forwards} forwards, "
          f"{stats.tokens_per_forward:.2f} tokens/forward, TTFT {stats.ttft_s * 1e3:.1f} ms, "
          f"latency {stats.latency_s * 1e3:.1f} ms")


main = hydra_app("generate", _generate)
