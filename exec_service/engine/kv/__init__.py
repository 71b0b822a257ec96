"""The paged KV cache: its layout and tensors, the blocks sequences hold, and the content hashes that let a later
prompt reuse them (prefix caching)."""
