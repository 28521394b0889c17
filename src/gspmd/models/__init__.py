"""Case studies from the paper as runnable, annotated JAX programs."""
