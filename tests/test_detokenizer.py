"""Streamed text through a real byte-level BPE tokenizer: what the messages carry joins into the full decode."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from exec_service.api.detokenizer import Detokenizer

# Multi-byte characters split across tokens: the detokenizer must hold them back until they are whole.
TEXT = "héllo 😀 wörld 日本語 🎉 naïve über café"


@pytest.fixture(scope="module")
def tokenizer():
    """Byte-level BPE (as Llama 3 and GPT-2 use), trained here on a few lines so that no download is needed."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld 😀 日本語 the quick brown fox", "naïve café résumé 🎉🎉 über", "plain ascii text"] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


def test_messages_join_into_the_full_text_and_never_split_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    rng = random.Random(0)
    for _ in range(50):
        detokenizer, pieces, start = Detokenizer(tokenizer), [], 0
        while start < len(ids):
            size = rng.randint(1, 3)  # messages of 1 to 3 tokens, as a lagging handler coalesces them
            pieces.append(detokenizer.add(ids[start:start + size]))
            start += size
        assert not any("\ufffd" in piece for piece in pieces)
        assert "".join(pieces) == TEXT


class WindowSizes(PreTrainedTokenizerFast):
    """The same tokenizer, noting how many tokens each decode was given."""

    sizes: list[int]

    def decode(self, token_ids, **kwargs):
        self.sizes.append(len(token_ids))
        return super().decode(token_ids, **kwargs)


def test_each_message_decodes_a_window_not_the_whole_output(tokenizer):
    measured = WindowSizes(tokenizer_object=tokenizer.backend_tokenizer)
    measured.sizes = []
    ids = tokenizer.encode(TEXT) * 40  # ~1000 tokens
    detokenizer = Detokenizer(measured)
    text = "".join(detokenizer.add([token]) for token in ids)
    assert text == TEXT * 40
    assert max(measured.sizes) <= 8  # bounded by the longest character's tokens, not by the output's length
