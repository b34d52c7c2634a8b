"""Model-free simulation: the real scheduler and KV manager, a scripted runner."""
