"""`hf-paged serve`: an OpenAI-compatible HTTP server on the paged `Engine` (needs the `serve` extra: fastapi and
uvicorn)."""
