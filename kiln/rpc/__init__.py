"""The gRPC edge both services share: the server scaffold (health, reflection, interceptors), tokens and roles,
TLS on either side, and ``kiln keygen``'s key material."""
