"""Kernel tests: each Triton kernel against its PyTorch reference."""
