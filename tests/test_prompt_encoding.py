"""Segment-wise prompt encoding gives exactly the tokenizer's whole-text ids, reuses the segments a
conversation already had, and turns itself off for tokenizers where cutting at markers changes ids."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loguru import logger
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from semantic.actors.prompting.chat_format import ChatFormat
from semantic.actors.prompting.prompt_encoding import SegmentEncoder

MARKUP = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im", "_end|>", "user", "assistant"]
SPACING = [" ", "  ", "\n", "\n\n", "\t", " \n "]
OTHER = ["é", "日本語", "🙂", "0", "123", "3.5", "Hello", "def f():"]

contents = st.lists(
    st.one_of(st.sampled_from(MARKUP + SPACING + OTHER), st.text(max_size=6)), max_size=8
).map("".join)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


def whole(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def render(tokenizer: Any, texts: list[str]) -> str:
    messages = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(texts)]
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text


def test_the_default_model_is_cut_at_its_turn_markers(tokenizer: Any) -> None:
    assert set(SegmentEncoder(tokenizer).markers) == {"<|im_start|>", "<|im_end|>"}


@settings(max_examples=60, deadline=None)
@given(earlier=st.lists(contents, min_size=1, max_size=5), reply=contents, follow_up=contents)
def test_segments_encode_to_the_whole_texts_ids_and_earlier_turns_come_from_the_cache(
    tokenizer: Any, earlier: list[str], reply: str, follow_up: str
) -> None:
    encoder = SegmentEncoder(tokenizer)
    first = render(tokenizer, earlier)
    assert encoder.encode(first, None) == whole(tokenizer, first)
    assert encoder.num_cache_misses == len(set(encoder.segments(first)))

    # The agent's next turn: the same conversation with a reply and a new message after it.
    extended = render(tokenizer, [*earlier, reply, follow_up])
    hits, misses = encoder.num_cache_hits, encoder.num_cache_misses
    assert encoder.encode(extended, None) == whole(tokenizer, extended)
    new_segments = set(encoder.segments(extended)) - set(encoder.segments(first))
    assert encoder.num_cache_misses - misses == len(new_segments)
    assert encoder.num_cache_hits - hits == len(list(encoder.segments(extended))) - len(new_segments)
    assert encoder.num_cache_hits > hits  # at least the template's own markers were reused

    raw = "".join([*earlier, reply, follow_up])  # text that is no rendered conversation at all
    assert encoder.encode(raw, None) == whole(tokenizer, raw)


def test_two_workers_sharing_a_small_cache_get_the_whole_texts_ids(tokenizer: Any) -> None:
    turns = [f"turn {i}: " + MARKUP[i % len(MARKUP)] + OTHER[i % len(OTHER)] * (i % 5) for i in range(40)]
    texts = [render(tokenizer, turns[:n]) for n in range(1, len(turns) + 1)] * 3
    encoder = SegmentEncoder(tokenizer, max_cached_chars=300)  # small enough to evict all the time
    with ThreadPoolExecutor(max_workers=2) as pool:
        encoded = list(pool.map(encoder.encode, texts, [None] * len(texts)))
    assert encoded == [whole(tokenizer, text) for text in texts]
    assert 0 < encoder.num_cached_chars <= 300
    assert encoder.num_cache_hits > 0


def cut_at(markers: list[str], tokenizer: Any, text: str) -> list[int]:
    """What cutting at `markers` would give, to show a case really breaks it."""
    pattern = "(" + "|".join(map(re.escape, markers)) + ")"
    return [i for segment in re.split(pattern, text) if segment for i in whole(tokenizer, segment)]


def test_a_prefix_space_only_at_the_start_of_the_text_turns_segments_off() -> None:
    # Llama 2 style: a sentencepiece space goes before the text's first word only, so text after a
    # marker encodes differently alone.
    vocab = {"<unk>": 0, "▁": 1, "h": 2, "i": 3, "hi": 4, "▁hi": 5, "▁h": 6}
    merges = [("h", "i"), ("▁", "h"), ("▁h", "i")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.add_special_tokens([AddedToken("<s>", normalized=False), AddedToken("</s>", normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    text = "<s>hi</s><s>hi</s>"
    assert cut_at(["<s>", "</s>"], tokenizer, "hi</s>hi") != whole(tokenizer, "hi</s>hi")

    logged: list[str] = []
    sink = logger.add(logged.append, level="INFO", format="{message}")
    try:
        chat = ChatFormat(tokenizer)
    finally:
        logger.remove(sink)
    assert chat.encoder.markers == ()
    assert sum("prompt segments off" in line for line in logged) == 1
    assert chat.encode(text, None) == whole(tokenizer, text)
    assert chat.encoder.num_cache_misses == chat.encoder.num_cache_hits == 0


def test_markers_that_swallow_nearby_spaces_are_not_cut_at(tokenizer: Any, default_model_dir: Path) -> None:
    spec = json.loads((default_model_dir / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["lstrip"] = token["rstrip"] = True
    stripping = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    stripping.chat_template = tokenizer.chat_template
    text = render(stripping, [" spaced ", "\nnewlines\n"])
    assert cut_at(["<|im_start|>", "<|im_end|>"], stripping, text) != whole(stripping, text)

    encoder = SegmentEncoder(stripping)
    assert encoder.markers == ()
    assert encoder.encode(text, None) == whole(stripping, text)
