"""Chat messages to prompt token ids through the model's own chat template.

Every protocol converts its wire messages to one form, the Hugging Face chat form: dicts with
`role` and string `content`, assistant `tool_calls` as `{"type": "function", "function": {"name",
"arguments": dict}}` and tool results as `role: "tool"`. Templates that know nothing of tools get
them Hermes-style: the tool list in the system message, calls as `<tool_call>` JSON and results as
`<tool_response>` user turns, which is also the form our tool-call parser reads back. Templates that
render tools get them as they are, and the model's calls are read in its own format
(`actors/prompting/tool_format.py`). An assistant's reasoning, where the client sent it back, is its
`reasoning_content`: the key the Qwen3, Qwen3.5 and GLM-4.6 templates read, each re-rendering the
turns it chooses (gpt-oss reads `thinking`, which we do not set).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from semantic.actors.prompting.prompt_encoding import SegmentEncoder
from semantic.actors.prompting.tool_format import HERMES, detect_tool_format
from semantic.engine.cache_store.cache_matching import common_prefix_length

ChatMessage = dict[str, Any]

_TOOL_INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class ChatTemplateError(ValueError):
    """The model's chat template rejected the messages."""


class ChatFormat:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        self.template_knows_tools = "tools" in template
        # The parser reads back what the prompt asks for: the model's own format where its template
        # renders the tools, Hermes where we describe them.
        self.tool_format = detect_tool_format(tokenizer) if self.template_knows_tools else HERMES
        self.encoder = SegmentEncoder(tokenizer)

    @property
    def tool_call_opener(self) -> str:
        """A call's opening up to the tool's name, less the `{"name": "` head of a JSON call."""
        return self.tool_format.forced_prefix(None).removesuffix('{"name": "')

    @property
    def tool_call_closer(self) -> str | None:
        """The text that ends a call block, where the format has one (Hermes/Qwen `</tool_call>`)."""
        return self.tool_format.end or None

    def forced_call_prefix(self, tool_name: str | None) -> str:
        """Reply text that opens a tool call: to `tool_name`, or to a tool the model names."""
        return self.tool_format.forced_prefix(tool_name)

    def render(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        kwargs: dict[str, Any] = {}
        if tools and self.template_knows_tools:
            kwargs["tools"] = tools
        else:
            messages = _hermes_messages(messages, tools)
        try:
            text: str = self.tokenizer.apply_chat_template(
                _merge_consecutive(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except Exception as error:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {error}") from error
        return text

    def head_length(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        text: str,
        token_ids: list[int],
        scope: str | None,
    ) -> int:
        """How many of `token_ids` (`text` encoded, rendered from `messages`) hold the leading system
        message and tools: what other agents' prompts are likely to share. 0 where there is none or
        the head does not encode to a prefix of the whole."""
        head = [m for m in messages[:1] if m["role"] == "system"]
        if not head:
            return 0
        try:
            head_text = self.render(head, tools, add_generation_prompt=False)
        except ChatTemplateError:
            return 0
        if not head_text or not text.startswith(head_text) or len(head_text) == len(text):
            return 0
        head_ids = self.encode(head_text, scope)
        return len(head_ids) if token_ids[: len(head_ids)] == head_ids else 0

    def generation_prompt_start(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        text: str,
        token_ids: list[int],
        scope: str | None,
    ) -> int:
        """How many of `token_ids` (`text` encoded, rendered from `messages`) come before the
        generation prompt (the assistant header the reply follows): a template that re-renders the
        reply rewrites what follows, so the next prompt shares at least these. 0 where the messages
        rendered without it are not the start of `text`."""
        try:
            bare = self.render(messages, tools, add_generation_prompt=False)
        except ChatTemplateError:
            return 0
        if not bare or not text.startswith(bare) or len(bare) == len(text):
            return 0
        # Where a token spans the cut, the ids the two share end before it.
        return common_prefix_length(self.encode(bare, scope), token_ids)

    def encode(self, text: str, scope: str | None) -> list[int]:
        """Token ids of rendered text; the template already wrote any BOS. `scope`: the turn's cache
        salt, which the encoder's cache is kept under (prompt_encoding.py)."""
        return self.encoder.encode(text, scope)

    def continuation(self, system: str | None, new_messages: list[ChatMessage]) -> str:
        """The text that follows a finished assistant turn to add `new_messages` and open the next one.

        Rendered around a marker reply, so whatever the template puts between turns (end-of-turn
        tokens, headers) comes out exactly as it would in a full render. The marker is new on every
        call, so no message can spell it and move the cut.
        """
        marker = f"\u2063semantic-turn-{secrets.token_hex(16)}\u2063"
        head: list[ChatMessage] = [{"role": "system", "content": system}] if system else []
        head += [{"role": "user", "content": "."}, {"role": "assistant", "content": marker}]
        text = self.render(head + new_messages)
        if text.count(marker) != 1:
            raise ChatTemplateError("the model's chat template drops assistant turns; cannot continue")
        return text[text.index(marker) + len(marker) :]

    def opening(self, system: str | None, new_messages: list[ChatMessage]) -> str:
        """The whole prompt of a conversation's first turn."""
        head: list[ChatMessage] = [{"role": "system", "content": system}] if system else []
        return self.render(head + new_messages)


def _merge_consecutive(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Join back-to-back user (or assistant) turns and move late system messages into user turns:
    templates demand alternating roles and a single leading system message."""
    runs: list[tuple[ChatMessage, list[str]]] = []  # a message, and the texts it stands for
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "system" and index > 0:
            message = {"role": "user", "content": message.get("content") or ""}
            role = "user"
        content = message.get("content")
        if runs:
            previous, texts = runs[-1]
            if (
                role in ("user", "assistant")
                and previous["role"] == role
                and not previous.get("tool_calls")
                and not message.get("tool_calls")
                and texts
                and isinstance(content, str)
            ):
                texts.append(content)  # joined once below: a long run costs linear time
                continue
        runs.append((message, [content] if isinstance(content, str) else []))
    return [
        message if len(texts) < 2 else {**message, "content": "\n\n".join(texts)} for message, texts in runs
    ]


def _hermes_messages(messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                + "\n</tool_call>"
                for c in message["tool_calls"]
            )
            content = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            out.append(
                {
                    "role": "user",
                    "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>",
                }
            )
        else:
            out.append({"role": role, "content": message.get("content") or ""})
        if message.get("reasoning_content"):  # an assistant's, for templates that re-render it
            out[-1]["reasoning_content"] = message["reasoning_content"]
    if tools:
        listing = _TOOL_INSTRUCTIONS.format(tools="\n".join(json.dumps(tool) for tool in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out
