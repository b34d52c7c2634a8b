"""Real model execution: a Llama-family model over the paged KV cache the scheduler manages.

This package imports torch (lazily, module by module); nothing on the scheduling path
imports it. `errors`, `spec` and `workload` are plain Python so that the command line can
name their errors without loading torch."""
