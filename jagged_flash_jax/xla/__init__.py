"""Pure-JAX (`xla`) backends of the ops beyond standard attention: blockwise, flash-style, on any device."""
