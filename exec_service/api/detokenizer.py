"""Text for streamed tokens: each message carries the text its tokens added, never half a UTF-8 character, and the
stream ends at a stop string, whose text is never sent.

``tokenizers``' DecodeStream does the incremental decoding (it keeps only the few tokens a character can still
depend on, so a message costs the same however long the output grows, as vLLM's incremental detokenizer does).
Stop strings are matched on that decoded text, across token and message boundaries: text that could still be the
start of a stop string is held back until the next tokens say whether it is (vLLM holds back the same way).
"""

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream


@dataclass(frozen=True)
class Detokenized:
    text: str  # what these tokens add to the output, to send
    num_tokens: int  # how many of them the output keeps: all, or up to the one that completed a stop string
    stopped: bool  # a stop string matched: the output ends here, without it


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0):
        """``tokenizer``: a transformers tokenizer with a fast (``tokenizers``) backend. ``stop``: strings that end
        the output, matched once ``min_tokens`` tokens are out (as vLLM's stop checker does)."""
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._held = ""  # decoded text not sent yet: it may be the start of a stop string

    def add(self, token_ids: list[int], last: bool = False) -> Detokenized:
        """The text ``token_ids`` add to the output so far; held back while it ends inside a character or could
        still begin a stop string. ``last``: the output ends after these, so nothing is held any more."""
        pieces = []
        for i, token_id in enumerate(token_ids):
            piece = self._stream.step(self._backend, token_id)
            self._num_tokens += 1
            if not piece:
                continue
            if not self._stop or self._num_tokens < self._min_tokens:
                pieces.append(piece)
                continue
            self._held += piece
            at = min((found for found in (self._held.find(s) for s in self._stop) if found >= 0), default=-1)
            if at >= 0:
                pieces.append(self._held[:at])
                self._held = ""
                return Detokenized("".join(pieces), i + 1, True)
            keep = self._stop_prefix_length(self._held)
            pieces.append(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
        if last:
            pieces.append(self._held)
            self._held = ""
        return Detokenized("".join(pieces), len(token_ids), False)

    def _stop_prefix_length(self, text: str) -> int:
        """The longest end of ``text`` that a stop string begins with (and is not the whole stop string)."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


def token_texts(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token's own text (special tokens included), as logprobs show it: a token inside a multi-byte character
    shows the replacement character, as vLLM's and OpenAI's do."""
    return tokenizer.backend_tokenizer.decode_batch([[t] for t in token_ids], skip_special_tokens=False)
