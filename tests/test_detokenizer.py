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


def streamed(detokenizer: Detokenizer, ids: list[int], rng: random.Random) -> tuple[str, int, bool]:
    """Through ``detokenizer`` in messages of 1 to 3 tokens, as the engine's steps deliver them: the text sent, the
    tokens kept and whether a stop string ended it."""
    text, kept, start = "", 0, 0
    while start < len(ids):
        chunk = ids[start:start + rng.randint(1, 3)]
        start += len(chunk)
        piece = detokenizer.add(chunk, last=start >= len(ids))
        assert "\ufffd" not in piece.text
        text, kept = text + piece.text, kept + piece.num_tokens
        if piece.stopped:
            return text, kept, True
    return text, kept, False


@pytest.mark.parametrize("stop", ["wörld", "ö", "😀 日", "本語 🎉", "é over", "café", "TEXT NOT THERE", "üb", "h"])
def test_stop_strings_end_the_text_before_them_across_tokens_and_messages(tokenizer, stop):
    ids = tokenizer.encode(TEXT)
    found = TEXT.find(stop)
    # The token whose text completes the first match: the output keeps the tokens up to it.
    ending = next((i for i in range(len(ids)) if stop in tokenizer.decode(ids[:i + 1])), None)
    rng = random.Random(1)
    for _ in range(30):
        text, kept, stopped = streamed(Detokenizer(tokenizer, ("never there", stop)), ids, rng)
        if found < 0:
            assert (text, kept, stopped) == (TEXT, len(ids), False)
        else:
            assert (text, kept, stopped) == (TEXT[:found], ending + 1, True)


def test_text_that_may_begin_a_stop_string_is_held_until_it_cannot(tokenizer):
    ids = tokenizer.encode(TEXT)
    detokenizer, sent, held = Detokenizer(tokenizer, ("naïve X",)), "", 0
    for i, token in enumerate(ids):
        sent += detokenizer.add([token]).text
        if tokenizer.decode(ids[:i + 1]).endswith("naïve"):  # it may still become "naïve X"
            assert sent == TEXT[:TEXT.index("naïve")]
            held += 1
    assert held and sent == TEXT  # " ü" said it does not
    # Text that could begin a stop string at the end of the output goes out with the last message.
    detokenizer = Detokenizer(tokenizer, ("café!",))
    pieces = [detokenizer.add([token]).text for token in ids[:-1]]
    last = detokenizer.add(ids[-1:], last=True).text
    assert not "".join(pieces).endswith("caf") and last.endswith("café") and "".join(pieces) + last == TEXT


def test_stop_strings_count_from_min_tokens_on(tokenizer):
    ids = tokenizer.encode(TEXT)
    early = len(tokenizer.encode("héllo"))  # "llo" is complete within the first tokens
    assert Detokenizer(tokenizer, ("llo",)).add(ids).stopped
    piece = Detokenizer(tokenizer, ("llo",), min_tokens=early + 1).add(ids, last=True)
    assert not piece.stopped and piece.text == TEXT
