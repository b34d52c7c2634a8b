"""Replays: engine state at any step of a trace, breakpoints, re-simulation and diff.

The reducer (`replays.reducer`) rebuilds the engine's state from trace records alone;
`replays.state.State` is that state."""
