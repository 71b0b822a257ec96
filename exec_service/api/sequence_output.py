"""One of a Generate's sequences as it goes out: its text, where a stop string ends it, its logprobs' texts."""

import dataclasses

from exec_service.api import messages
from exec_service.api.detokenizer import Detokenizer, token_texts
from exec_service.engine.request_stream import RequestOutput
from exec_service.engine.sequence import FinishReason, Sequence
from protos import exec_pb2


class SequenceOutput:
    def __init__(self, seq: Sequence, tokenizer, stop: tuple[str, ...]):
        self.seq = seq
        self._tokenizer = tokenizer
        self._detokenizer = Detokenizer(tokenizer, stop, seq.params.min_tokens) if tokenizer is not None else None
        self.num_sent = 0  # tokens sent
        self.done = False  # its last message is sent
        self.stopped = False  # a stop string ended it before the engine did: the engine is to stop it

    def response(self, output: RequestOutput) -> exec_pb2.GenerateResponse:
        """The message for the engine's ``output`` of this sequence: its tokens up to a stop string, if one matched,
        and then the sequence's end (STOP, with the usage of what was sent)."""
        token_ids, logprobs, finish_reason, usage, text = (output.token_ids, output.logprobs, output.finish_reason,
                                                            output.usage, "")
        if self._detokenizer is not None:
            piece = self._detokenizer.add(token_ids, last=output.is_last)
            text = piece.text
            if piece.stopped:
                token_ids = token_ids[:piece.num_tokens]
                logprobs = logprobs[:piece.num_tokens] if logprobs is not None else None
                finish_reason, self.stopped = FinishReason.STOP, not output.is_last
                # The engine's usage counts what it sampled; this sequence's output ends at the stop string.
                usage = dataclasses.replace(usage or self.seq.usage(), output_tokens=self.num_sent + len(token_ids))
        self.num_sent += len(token_ids)
        self.done = finish_reason is not None
        texts = None
        if logprobs and self._tokenizer is not None:
            ids = sorted({t for logprob in logprobs for t in (logprob.token_id, *(top for top, _ in logprob.top))})
            texts = dict(zip(ids, token_texts(self._tokenizer, ids), strict=True))
        return messages.generate_response(token_ids, text, finish_reason, usage, self.seq.index, logprobs, texts)
