"""Compiled-graph runtime: piecewise torch.compile, CUDA graph capture and the artifact cache."""
