"""Small GPU probes behind statements in docs/performance.md (run from the repository root)."""
