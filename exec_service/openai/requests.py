"""OpenAI's request bodies (``/v1/completions``, ``/v1/chat/completions``), checked and mapped to GenerateRequests.

The bounds are OpenAI's documented ones where it has them, and Kiln's (stated in protos/exec.proto) where the
execute service is stricter; the execute service checks every field again. Parameters Kiln cannot honour
(``logit_bias``, ``tools`` and ``functions``, ``echo``, ``suffix``, a JSON ``response_format``) are refused by name
rather than ignored, so a client never gets output that silently disregards what it asked for. Besides OpenAI's
fields, the extras vLLM's clients send: ``top_k``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, and ``return_token_ids`` (each choice and chunk also carries its ``token_ids``).
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from exec_service.openai.errors import invalid
from kiln.rpc.field_bounds import MAX_N, MAX_TOP_LOGPROBS
from protos import exec_pb2

MAX_PROMPTS = 64  # prompts in one /v1/completions body
MAX_CHOICES = 256  # prompts x n
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
INT32_MAX = 2**31 - 1
INT64 = 2**63

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")  # e.g. ``user``, ``metadata``: carried by clients, no effect here

    model: str = Field(min_length=1, max_length=128)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: Stop | list[Stop] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int = Field(0, ge=0, le=INT32_MAX)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP)
    return_token_ids: bool = False

    def check_common(self) -> None:
        if self.logit_bias:
            raise invalid("logit_bias is not supported by Kiln", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options: only allowed when stream is true", "stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP:
            raise invalid(f"stop: {len(stops)} strings, at most {MAX_STOP}", "stop")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def generate_request(self, max_tokens: int | None) -> exec_pb2.GenerateRequest:
        """The sampling part of the GenerateRequest; the caller sets the prompt (or messages) and logprobs."""
        request = exec_pb2.GenerateRequest(
            model=self.model, top_k=self.top_k, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            stop=self.stops, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens, n=self.n)
        for field, value in (("max_tokens", max_tokens), ("temperature", self.temperature), ("top_p", self.top_p),
                             ("seed", self.seed), ("repetition_penalty", self.repetition_penalty)):
            if value is not None:
                setattr(request, field, value)
        return request


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the body: a string or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise invalid("prompt: empty", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise invalid(f"prompt: {len(prompts)} prompts in one request, at most {MAX_PROMPTS}", "prompt")
        return prompts

    def generate_requests(self) -> list[exec_pb2.GenerateRequest]:
        """One GenerateRequest per prompt (its n sequences share its prefill in the execute service)."""
        self.check_common()
        if self.echo:
            raise invalid("echo is not supported by Kiln", "echo")
        if self.suffix:
            raise invalid("suffix is not supported by Kiln", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of: only best_of equal to n is supported", "best_of")
        prompts = self.prompts()
        if len(prompts) * self.n > MAX_CHOICES:
            raise invalid(f"n: {len(prompts)} prompts x n {self.n} is over {MAX_CHOICES} choices", "n")
        requests = []
        for prompt in prompts:
            request = self.generate_request(self.max_tokens)
            if isinstance(prompt, str):
                request.prompt = prompt
            else:
                request.prompt_ids.extend(prompt)
            if self.logprobs is not None:
                request.logprobs = True
                request.top_logprobs = self.logprobs
            requests.append(request)
        return requests


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # ``name``

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ResponseFormat(BaseModel):
    type: str


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageBody] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None
    functions: list[dict] | None = None  # the API's older form of tools
    response_format: ResponseFormat | None = None

    def generate_requests(self) -> list[exec_pb2.GenerateRequest]:
        self.check_common()
        for field in ("tools", "functions"):
            if getattr(self, field):
                raise invalid(f"{field} are not supported by Kiln", field)
        if self.response_format is not None and self.response_format.type != "text":
            raise invalid(f"response_format: only type 'text' is supported, not {self.response_format.type!r}",
                          "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs: needs logprobs set to true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # Unset: until the end of the sequence or the model's max_model_len, as OpenAI's and vLLM's chat answer.
        request = self.generate_request(INT32_MAX if max_tokens is None else max_tokens)
        # "developer" is what newer clients call the system message; chat templates know "system".
        request.messages.extend(exec_pb2.ChatMessage(role="system" if m.role == "developer" else m.role,
                                                     content=m.text()) for m in self.messages)
        request.logprobs = self.logprobs
        request.top_logprobs = self.top_logprobs or 0
        return [request]
