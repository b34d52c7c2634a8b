"""`schedtop serve`: an OpenAI-compatible HTTP front for LLMEngine.

    loop.EngineLoop    one thread that owns the LLMEngine; queues in and out
    detok              incremental detokenization and stop strings
    protocol           the request bodies (validated) and response shapes
    metrics            Prometheus metrics under vLLM's names
    app                the FastAPI routes
    recording          what the server needs from a flight recorder (a Protocol)

Nothing here imports the recorder: the `serve` command wires one in."""
