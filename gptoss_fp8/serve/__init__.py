"""``gptoss-fp8 serve``: an OpenAI-compatible HTTP server over the runtime's engine (docs/serve.md).

``harmony`` renders chat requests to token ids and parses replies (openai-harmony), ``schema``
holds the request bodies (pydantic, unknown fields refused), ``app`` the FastAPI routes and the
bridge from the engine's thread to asyncio, ``server`` builds the engine from a checkpoint and
runs uvicorn. The HTTP side never touches tensors; the runtime never sees JSON.
"""
