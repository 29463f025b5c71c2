"""Structured output for block diffusion: a grammar per request (JSON schema, regex, Lark) held by an
llguidance matcher, and the block-aware rule that keeps every committed prefix valid (DESIGN §14,
docs/structured_output.md)."""
from fluxlab.engine.constraint.grammar import GRAMMAR_KINDS, Grammar, grammar_of_response_format
from fluxlab.engine.constraint.matcher import Constraint, GrammarVocab

__all__ = ["GRAMMAR_KINDS", "Constraint", "Grammar", "GrammarVocab", "grammar_of_response_format"]
