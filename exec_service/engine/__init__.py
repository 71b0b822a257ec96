"""The serving loop and what it drives: scheduler, KV blocks, sequences, sampler and the model runner (its forward,
step inputs, decode and mixed CUDA graphs).

Python types only: the engine knows nothing of gRPC or protobuf; the API edge (exec_service.api) converts."""
