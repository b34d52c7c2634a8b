"""`schedtop serve`: an OpenAI-compatible HTTP front for LLMEngine, in a layer above the
engine and the recorder (as vLLM keeps `entrypoints/` above `v1/engine`): the engine
knows nothing of HTTP, FastAPI or Prometheus; this package imports the engine's public
API (LLMEngine, its stats) and the recorder's server recording.

    loop.EngineLoop    one thread that owns the LLMEngine; queues in and out
    detok              incremental detokenization and stop strings
    protocol           the request bodies (validated) and response shapes
    metrics            Prometheus metrics under vLLM's names, from the engine's stats
    app                the FastAPI routes
    server             builds the engine like `run`, binds the socket, runs uvicorn"""
