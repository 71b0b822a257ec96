"""What a stream that ends before its last message raises."""


class StreamIncomplete(RuntimeError):
    """A Compile stream without a result, or a LoadModel stream without ``ready``: the server ended it early
    without a status (a status would have raised grpc.RpcError)."""
