"""The model: which configs Kiln serves (spec, features, presets, roots), how a causal LM is built on the device as
the token-flat module Kiln compiles layer by layer, and how a checkpoint's tensors are checked and loaded into it."""
