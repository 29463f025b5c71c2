"""Model building blocks: norms, rotary, linear (TP-ready), MoE, dense block-causal attention."""
