"""The attention op: the ``kiln::attention`` custom op the graph splits at, its per-step forward context (block
tables, slot mapping), the Triton kernels that run it on CUDA and the plain-torch reference that runs it on CPU."""
