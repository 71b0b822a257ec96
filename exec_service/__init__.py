"""The execute service: loads compiled bundles without compiling and serves generation with continuous batching.

server.py starts it; api/ is its gRPC edge, startup/ brings a model up phase by phase, engine/ is the serving loop,
telemetry/ what it reports. Imports run api -> startup -> engine; the engine knows no protobuf.
"""
