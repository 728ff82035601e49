"""How a kernel runs: `calls` builds the kernel launches from their specs; `gpu` runs them through
jax-triton, `interpret` in Triton's interpreter on the CPU."""
