"""What a full KV block is known by in the prefix cache: a sha256 chain over the model and the tokens before it.

A block's keys and values depend on every token up to its last one (through the layers' attention) and on the model
that computed them, so its hash covers exactly that: the root hash of the model's identity (the bundle key, the model
config, dtype and quantization, the weights, block size, KV window and runtime mode: ``model_root``), then one link
per block over (the previous block's hash, the block's token ids). Two blocks with the same hash hold the same KV.

sha256, not Python's ``hash``: a collision would serve one prompt the keys and values of another (wrong tokens, and
another client's context leaking into the answer). Python's hash of ints and tuples is 64 bits, unseeded and
invertible, so a client could craft prompts that collide on purpose; a 256-bit cryptographic hash makes that
infeasible. The encoding is canonical and fixed-width (32 hash bytes, then int64 token ids), so distinct inputs are
distinct bytes. Hashes never leave the process.
"""

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence

_DOMAIN = b"kiln.prefix-cache.v1"


def model_root(identity: Mapping[str, str | int | bool]) -> bytes:
    """The hash the chain starts from: everything besides the tokens that changes what a block holds."""
    canonical = json.dumps(dict(identity), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(_DOMAIN + canonical).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block of ``token_ids`` following the block (or root) hashed ``parent``."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_chain(hashes: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int, num_blocks: int) -> None:
    """Extend ``hashes`` (the chain of the first full blocks of ``token_ids``) to ``num_blocks`` blocks."""
    parent = hashes[-1] if hashes else root
    for index in range(len(hashes), num_blocks):
        parent = block_hash(parent, token_ids[index * block_size:(index + 1) * block_size])
        hashes.append(parent)
