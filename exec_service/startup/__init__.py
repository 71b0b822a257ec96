"""Bringing a model up for LoadModel, phase by phase (load_model.py runs them): fetch the bundle (fetch.py), load
weights (weights.py), profile memory (memory_profile.py), load the compiled function (compiled_function.py), capture
CUDA graphs (graph_capture.py), the KV cache sized once what it must leave room for is measured (kv_sizing.py); then
the engine gets a finished ModelRunner."""
