"""Back-to-back turns of one role are joined before a template renders them (templates demand
alternating roles), in one pass: a request of many short same-role messages costs linear time."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from semantic.actors.prompting.chat_format import _merge_consecutive


def merged_pairwise(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rule, applied a message at a time (each join copies the text so far)."""
    merged: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if message["role"] == "system" and index > 0:
            message = {"role": "user", "content": message.get("content") or ""}
        previous = merged[-1] if merged else None
        if (
            previous is not None
            and message["role"] in ("user", "assistant")
            and previous["role"] == message["role"]
            and not previous.get("tool_calls")
            and not message.get("tool_calls")
            and isinstance(previous.get("content"), str)
            and isinstance(message.get("content"), str)
        ):
            merged[-1] = {**previous, "content": previous["content"] + "\n\n" + message["content"]}
        else:
            merged.append(message)
    return merged


contents = st.one_of(st.text(max_size=8), st.none(), st.just([{"type": "text", "text": "part"}]))
messages = st.lists(
    st.builds(
        lambda role, content, calls: (
            {"role": role, "content": content}
            | ({"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]} if calls else {})
        ),
        st.sampled_from(["system", "user", "assistant", "tool"]),
        contents,
        st.booleans(),
    ),
    max_size=12,
)


@given(messages)
def test_runs_are_joined_as_one_join_at_a_time_would(conversation: list[dict[str, Any]]) -> None:
    assert _merge_consecutive(conversation) == merged_pairwise(conversation)


def test_a_long_run_of_user_messages_becomes_one() -> None:
    run = [{"role": "user", "content": str(i)} for i in range(50_000)]
    (merged,) = _merge_consecutive(run)
    assert merged == {"role": "user", "content": "\n\n".join(str(i) for i in range(50_000))}
