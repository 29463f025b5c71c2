"""SDAR / TraDo (JetAstra/SDAR, Gen-Verse TraDo): Qwen3-based block diffusion, dense and MoE."""
