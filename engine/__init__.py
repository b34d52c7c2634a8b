"""The serving engine: a vLLM-V1-style scheduler over a paged KV cache, and the runners
that execute its decisions (a simulated one here, the real model in `engine.model`).

Importing this package is cheap: nothing on the scheduling path imports torch."""
