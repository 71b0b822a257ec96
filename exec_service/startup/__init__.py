"""Bringing a model up for LoadModel, phase by phase: fetch the bundle, load weights, profile memory, size the KV
cache, load the compiled function, capture CUDA graphs."""
