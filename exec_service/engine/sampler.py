"""Batched sampling for one step: greedy, temperature, top-k, top-p and per-request seeds, one host sync in all.

Sampling draws exponential noise and takes ``argmax(probs / noise)``, which picks token i with probability
``probs[i]`` (nano-vllm's trick) without a multinomial per row. A seeded request draws its noise from its own
generator, so its tokens do not depend on which other requests share the step.
"""

import torch

from exec_service.engine.sequence import Sequence


class Sampler:
    def __init__(self, device: str):
        self.device = device

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits [B, V] float32, one row per sequence -> B token ids (the step's only device->host copy)."""
        if not seqs:
            return []
        greedy = logits.argmax(dim=-1)
        if all(seq.params.is_greedy for seq in seqs):
            return greedy.tolist()
        params = [seq.params for seq in seqs]
        temperature = self._column([p.temperature or 1.0 for p in params], torch.float32)
        logits = logits / temperature[:, None]
        if any(p.top_k for p in params) or any(p.top_p < 1.0 for p in params):
            logits = self._top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[row].exponential_(generator=seq.generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        is_greedy = self._column([p.is_greedy for p in params], torch.bool)
        return torch.where(is_greedy, greedy, sampled).tolist()

    def _column(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _top_k_top_p(self, logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Mask to -inf every token outside its row's k most likely and outside its smallest top-p nucleus."""
        vocab = logits.shape[-1]
        ordered, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)
        k = self._column([k or vocab for k in top_k], torch.int64)
        ordered = ordered.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays: its mass_before is 0
        ordered = ordered.masked_fill(mass_before > self._column(top_p, torch.float32)[:, None], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(-1, order, ordered)
