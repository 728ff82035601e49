"""The pure-JAX (`xla`) implementations: blockwise, any device. `softmax` is jagged_attention's, `hstu`
HSTU attention's."""
