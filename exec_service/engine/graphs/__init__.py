"""CUDA graphs a step replays, each of a whole step, attention included: decode graphs by batch size for decode-only
batches, mixed graphs by token count for prefill and mixed steps."""
