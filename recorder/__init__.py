"""The flight recorder: turns engine step reports into a crash-safe msgpack trace."""
