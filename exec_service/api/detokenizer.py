"""Text for streamed tokens: each message carries the text its tokens added, never half a UTF-8 character.

``tokenizers``' DecodeStream does the incremental decoding (it keeps only the few tokens a character can still
depend on, so a message costs the same however long the output grows, as vLLM's incremental detokenizer does).
"""

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer):
        """``tokenizer``: a transformers tokenizer with a fast (``tokenizers``) backend."""
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """The text ``token_ids`` add to the output so far; held back while it ends inside a character."""
        pieces = (self._stream.step(self._backend, token_id) for token_id in token_ids)
        return "".join(piece for piece in pieces if piece)
