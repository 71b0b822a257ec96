"""The execute service's gRPC edge: the servicer, the requests checked field by field, protobuf conversion."""
