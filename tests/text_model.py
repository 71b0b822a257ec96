"""A tiny model directory with text: the tiny-llama config, a byte-level BPE tokenizer trained here with the
``tokenizers`` library (so any text round-trips), and a chat template. Weights stay dummy."""

import json
from pathlib import Path

from kiln.model.presets import PRESETS

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a kiln compiles the model once and serves it without compiling",
    "hello world, hello kiln: tokens in, tokens out",
    "system user assistant said the weather is fine today",
] * 20
# Roles and contents as tags, then the assistant's turn when a generation prompt is asked for.
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_text_model(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    config = PRESETS["tiny-llama"]
    (path / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # <unk> <s> </s> first: ids 0, 1, 2, the config's bos and eos; the byte alphabet after them, merges up to the
    # model's vocabulary.
    trainer = trainers.BpeTrainer(vocab_size=config["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path
