"""GenerateResponses as OpenAI's objects: choices, logprobs, usage, and the whole (non-streamed) completion.

A body's prompts each stream their n sequences (GenerateResponse.index); choice ``i`` of the answer is sequence
``i % n`` of prompt ``i // n``, as OpenAI numbers them.
"""

import time
import uuid
from dataclasses import dataclass, field

from protos import exec_pb2

FINISH_REASONS = {exec_pb2.FINISH_REASON_STOP: "stop", exec_pb2.FINISH_REASON_LENGTH: "length"}


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def token_text(logprob: exec_pb2.TokenLogprob) -> str:
    """A token's text, or ``token_id:N`` where the model has no tokenizer (as vLLM writes it)."""
    return logprob.token or f"token_id:{logprob.token_id}"


def completion_logprobs(logprobs, text_offset: int) -> dict:
    """``/v1/completions``' logprobs object for these tokens, their offsets counted from ``text_offset``."""
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(text_offset)
        tokens.append(token_text(lp))
        text_offset += len(lp.token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{token_text(t): t.logprob for t in lp.top} for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(logprobs) -> dict:
    """``/v1/chat/completions``' logprobs object for these tokens."""
    def entry(lp: exec_pb2.TokenLogprob) -> dict:
        text = token_text(lp)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp), "top_logprobs": [entry(t) for t in lp.top]} for lp in logprobs],
            "refusal": None}


@dataclass
class Choice:
    """One sequence as it accumulates."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class UsageCount:
    """Tokens of a whole body: each prompt once (with what its first prefill found in the prefix cache), every
    sequence's output."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> its tokens
    cached_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> of those, found in the cache
    completion_tokens: int = 0

    def add(self, prompt: int, response: exec_pb2.GenerateResponse) -> None:
        if response.HasField("usage"):
            self.prompt_tokens[prompt] = response.usage.prompt_tokens
            # The first of a prompt's n sequences computes its prefill; the others find it cached: the prompt's
            # figure is what its first sequence found.
            self.cached_tokens[prompt] = min(self.cached_tokens.get(prompt, response.usage.cached_tokens),
                                             response.usage.cached_tokens)
            self.completion_tokens += response.usage.output_tokens

    def body(self) -> dict:
        prompt_tokens = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}


class Completion:
    """The whole answer to a non-streamed request, built from every prompt's streamed responses."""

    def __init__(self, n: int, chat: bool, model: str, want_logprobs: bool, want_token_ids: bool = False):
        self.n = n
        self.chat = chat
        self.model = model
        self.want_logprobs = want_logprobs
        self.want_token_ids = want_token_ids
        self.choices: dict[int, Choice] = {}
        self.usage = UsageCount()

    def add(self, prompt: int, response: exec_pb2.GenerateResponse) -> None:
        choice = self.choices.setdefault(prompt * self.n + response.index, Choice())
        choice.text.append(response.text)
        choice.token_ids.extend(response.token_ids)
        choice.logprobs.extend(response.logprobs)
        if response.finish_reason:
            choice.finish_reason = FINISH_REASONS.get(response.finish_reason)
        self.usage.add(prompt, response)

    def body(self) -> dict:
        choices = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            text = "".join(choice.text)
            logprobs = None
            if self.want_logprobs:
                logprobs = chat_logprobs(choice.logprobs) if self.chat else completion_logprobs(choice.logprobs, 0)
            if self.chat:
                body = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                        "finish_reason": choice.finish_reason}
            else:
                body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
            if self.want_token_ids:
                body["token_ids"] = choice.token_ids
            choices.append(body)
        return {"id": completion_id("chatcmpl" if self.chat else "cmpl"),
                "object": "chat.completion" if self.chat else "text_completion", "created": now(),
                "model": self.model, "choices": choices, "usage": self.usage.body()}
