"""GenerateRequest.messages as prompt text: the model's own chat template, with the generation prompt.

The template is ``tokenizer_config.json``'s ``chat_template`` (or ``chat_template.jinja``) in the model directory the
operator chose; transformers' ``apply_chat_template`` renders it. Templates are Jinja, and transformers 5.x runs them
in jinja2's ``ImmutableSandboxedEnvironment`` (``transformers/utils/chat_template_utils.py``,
``_cached_compile_jinja_template``, read in 5.24; tests/test_sampling_options.py checks it on the transformers that
runs them): a template reads the messages and calls what transformers gives it (``raise_exception``,
``strftime_now``, ``tojson``), but cannot reach Python attributes, modules or files, nor change what it is given.
The messages are the client's: bounded in number and size here before rendering, and the rendered text bounded
before it is tokenized.
"""

import jinja2

from kiln.errors import InvalidArgument, quote

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 1024
# Characters of content (and of the rendered chat) per token of max_model_len: a generous ceiling on what can
# still tokenize into a prompt that fits, so text that cannot fit is refused before the tokenizer sees it.
MAX_CHARS_PER_TOKEN = 32


def chat_prompt(messages, tokenizer, model: str, max_model_len: int) -> str:
    """The rendered chat for ``messages`` (ChatMessage protos); INVALID_ARGUMENT naming ``messages`` at fault."""
    if tokenizer is None:
        raise InvalidArgument(f"messages: model {model!r} has no tokenizer, so no chat template; send prompt_ids")
    if not tokenizer.chat_template:
        raise InvalidArgument(f"messages: model {model!r} has no chat template (tokenizer_config.json's "
                              f"chat_template); send prompt or prompt_ids")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages: {len(messages)} messages, more than {MAX_MESSAGES}")
    max_chars = MAX_CHARS_PER_TOKEN * max_model_len
    chat, chars = [], 0
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role: {quote(message.role)} is not one of {', '.join(ROLES)}")
        chars += len(message.content)
        chat.append({"role": message.role, "content": message.content})
    if chars > max_chars:
        raise InvalidArgument(f"messages: {chars} characters of content cannot fit in max_model_len {max_model_len} "
                              f"tokens (at most {max_chars} characters)")
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as exc:  # the template's raise_exception, e.g. roles that must alternate
        raise InvalidArgument(f"messages: the chat template of {model!r} refused them: {quote(str(exc))}") from None
    if len(text) > max_chars:
        raise InvalidArgument(f"messages: the rendered chat is {len(text)} characters, more than max_model_len "
                              f"{max_model_len} tokens can hold (at most {max_chars})")
    return text
