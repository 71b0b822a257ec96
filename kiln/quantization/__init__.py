"""FP8: weights and activations in float8_e4m3fn, the GEMMs in torch._scaled_mm; checkpoints that store them."""
