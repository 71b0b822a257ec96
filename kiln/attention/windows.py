"""Each layer's sliding window as the model's own modules pass it to Kiln's attention op, and the KV window: how many
of a sequence's latest tokens any later query can still read.

The windows are read from the op's calls in a one-token forward, not derived again from the config: families say
it differently (Mistral's and Phi-3's window reaches every layer, Qwen2 and Gemma 2 choose layers by layer types,
EXAONE 4 by a pattern), and what the op receives is what the kernels mask by. A model with one global layer reads
its whole context, so nothing of it may be freed.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kiln.attention.op  # noqa: F401  (registers kiln::attention)

_WINDOW_ARG = 5  # kiln::attention(q, k, v, layer_idx, scale, window=0, softcap=0.0)


class _AttentionCalls(TorchDispatchMode):
    """Records (layer_idx -> window) of every attention op call it sees and runs every op as it would run."""

    def __init__(self):
        super().__init__()
        self.windows: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.kiln.attention.default:
            window = args[_WINDOW_ARG] if len(args) > _WINDOW_ARG else kwargs.get("window", 0)
            self.windows[int(args[3])] = int(window)
        return func(*args, **kwargs)


@torch.no_grad()
def layer_windows(model: torch.nn.Module, device: str) -> dict[int, int]:
    """layer index -> its window (0: the whole context), from one token through ``model`` (a
    kiln.model.causal_lm.TokenModel) outside any engine step, so the op attends that token alone and touches no KV
    cache."""
    calls = _AttentionCalls()
    token = torch.zeros(1, dtype=torch.int64, device=device)
    with calls:
        model(token, token)
    if not calls.windows:
        raise RuntimeError(f"{type(model).__name__}: no layer called Kiln's attention op")
    return calls.windows


def kv_window(windows: dict[int, int]) -> int:
    """Tokens of a sequence's keys and values its next query may read: the widest window when every layer has
    one; 0 (all of them) when any layer attends the whole context."""
    return 0 if min(windows.values()) == 0 else max(windows.values())
