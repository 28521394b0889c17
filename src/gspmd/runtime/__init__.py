"""Executing programs: the NumPy simulator of N devices (sim) and, later, real JAX devices."""
