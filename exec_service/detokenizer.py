"""Text for streamed tokens: each message carries the text its tokens added, never half a UTF-8 character."""


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """The text ``token_ids`` add to the output so far (held back while it ends inside a character)."""
        self.token_ids += token_ids
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        # Held back while the text ends inside a character, or while decoding rewrote what was already sent.
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""
        new, self.text = text[len(self.text):], text
        return new
