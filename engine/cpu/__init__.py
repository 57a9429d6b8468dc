"""Kernels for MLX's CPU backend, installed by the backend profile on the CPU only."""
