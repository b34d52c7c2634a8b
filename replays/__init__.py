"""Replays: engine state at any step of a trace, breakpoints, re-simulation and diff."""
