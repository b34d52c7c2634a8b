"""One attention backend for prefill chunks and decodes in the same batch, over paged KV:
a PyTorch implementation (the CPU path and the oracle) and a Triton kernel (CUDA)."""
