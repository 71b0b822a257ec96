"""Bundles and where they live: the signed bundle format, the filesystem and Redis stores behind one interface,
their leases, and the Ed25519 signing that makes untrusted storage safe to unpickle from."""
