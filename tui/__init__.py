"""schedtop, the terminal UI: a live view of a running engine and a replay debugger."""
