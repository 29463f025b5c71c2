"""OpenAI-compatible HTTP server: async engine loop, FastAPI app, metrics, launcher (DESIGN §9)."""
