"""Triton kernels; each public op has a torch reference `<op>_ref` with the same signature."""
