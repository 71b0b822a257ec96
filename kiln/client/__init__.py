"""A Python client of Kiln's two services, the one the CLI, the benches and the tests use: channels with TLS and a
token, the requests built from plain values, Compile with its progress, LoadModel with its phases returning the
ready model's sizing, Generate as a stream, and failures said in words a person can act on."""
