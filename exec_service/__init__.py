"""The execute service: loads compiled bundles without compiling and serves generation with continuous batching."""
