"""The pure-JAX (`xla`) implementations: blockwise, any device."""
