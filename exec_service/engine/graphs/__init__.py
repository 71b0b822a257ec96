"""CUDA graphs a step replays: full graphs of the whole model for decode-only batches, piecewise graphs of the
compiled pieces between attention calls for prefill and mixed steps."""
