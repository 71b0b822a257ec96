"""Text for streamed tokens: each message carries the text its tokens added, never half a UTF-8 character."""


class Detokenizer:
    """Decodes a window (the tokens since the previous message's, as context, plus the new ones), not the whole
    output, so a message costs the same however long the output grows (vLLM's incremental detokenization)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self._context = 0  # the window starts here: tokens before it are never decoded again
        self._sent = 0  # tokens whose text has been sent

    def add(self, token_ids: list[int]) -> str:
        """The text ``token_ids`` add to the output so far (held back while it ends inside a character)."""
        self.token_ids += token_ids
        sent = self._decode(self.token_ids[self._context:self._sent])
        text = self._decode(self.token_ids[self._context:])
        # Held back while the text ends inside a character, or while decoding rewrote what was already sent.
        if text.endswith("\ufffd") or not text.startswith(sent) or len(text) == len(sent):
            return ""
        self._context, self._sent = self._sent, len(self.token_ids)
        return text[len(sent):]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
