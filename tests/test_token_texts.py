"""Token texts and bytes for log-probabilities, and where a reply that continues text starts reading,
with the default model's real tokenizer (a byte-level BPE that splits most non-Latin characters)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from semantic.engine.decoding.text_stream import TextStream, text_before
from semantic.engine.decoding.token_logprobs import TokenTexts


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):  # type: ignore[no-untyped-def]
    return load_tokenizer(default_model_dir)


def test_token_bytes_join_into_the_text_even_where_characters_split(tokenizer) -> None:  # type: ignore[no-untyped-def]
    texts = TokenTexts(tokenizer)
    text = "Tokyo is 東京 😀 and Paris"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [texts(i) for i in ids]
    assert any("\ufffd" in p.text for p in pieces)  # the test reaches split characters
    assert b"".join(p.raw for p in pieces).decode() == text  # each token's own bytes, exactly
    whole = [p.text for p in pieces if "\ufffd" not in p.text]
    assert " Paris" in whole and " is" in whole  # a token's leading space is part of its text


@pytest.mark.parametrize("prompt", ["The answer is", "I feel 😀", "Tokyo is 東京"])
def test_a_continued_reply_reads_on_from_whole_characters_and_keeps_its_space(tokenizer, prompt: str) -> None:  # type: ignore[no-untyped-def]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    follows = text_before(prompt_ids, tokenizer.decode)
    assert tokenizer.decode(follows).strip() and not tokenizer.decode(follows).startswith("\ufffd")
    stream = TextStream(tokenizer.detokenizer, (), tokenizer.eos_token_ids, follows)
    reply = "".join(stream.add_token(t) for t in tokenizer.encode(" yes, it is", add_special_tokens=False))
    assert reply + stream.finish() == " yes, it is"  # nothing of the prompt, and its first space
    plain = TextStream(tokenizer.detokenizer, (), tokenizer.eos_token_ids)
    first = "".join(plain.add_token(t) for t in tokenizer.encode(" yes", add_special_tokens=False))
    assert first + plain.finish() == "yes"  # a reply that starts a text: mlx-lm drops the space
