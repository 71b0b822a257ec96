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
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def test_messages_join_into_the_full_text_and_never_split_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    rng = random.Random(0)
    for _ in range(50):
        detokenizer, pieces, start = Detokenizer(tokenizer), [], 0
        while start < len(ids):
            size = rng.randint(1, 3)  # messages of 1 to 3 tokens, as a lagging handler coalesces them
            pieces.append(detokenizer.add(ids[start:start + size]).text)
            start += size
        assert not any("\ufffd" in piece for piece in pieces)
        assert "".join(pieces) == TEXT


def test_special_tokens_add_no_text(tokenizer):
    """As the whole decode skips them (skip_special_tokens): an end-of-sequence token sent as a message adds ''."""
    ids = tokenizer.encode(TEXT)
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.add([token]).text for token in [*ids, tokenizer.eos_token_id, *ids]]
    assert pieces[len(ids)] == ""
    assert "".join(pieces) == TEXT + TEXT == tokenizer.decode([*ids, tokenizer.eos_token_id, *ids],
                                                               skip_special_tokens=True)
