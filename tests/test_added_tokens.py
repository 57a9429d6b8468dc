"""Models whose chat markers are added tokens above the base vocabulary (Qwen's `<|im_start|>` is
151644 over a `vocab_size` of 151643; Llama 3's markers start at 128000) keep their agents'
caches and conversations across a restart: token ids read back from disk are bounded by the
model's embedding, not by the tokenizer's base vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from semantic.actors.engine_client import EngineConfig
from semantic.actors.system import AgentSystem, SystemConfig
from tests.tiny_models import TINY_CONFIGS, write_random_model

MARKERS = ("<|turn|>", "<|end_turn|>")  # ids 49152 and 49153: above the base vocabulary
TEMPLATE = (
    "{% for message in messages %}<|turn|>{{ message['role'] }}\n{{ message['content'] }}<|end_turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn|>assistant\n{% endif %}"
)


def model_with_added_markers(dest: Path, tokenizer_dir: Path) -> Path:
    base = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    num_base = len(base["model"]["vocab"])
    config = dict(TINY_CONFIGS["llama"], vocab_size=num_base + len(MARKERS))
    write_random_model(config, dest, tokenizer_dir)
    added = [
        {"id": num_base + i, "content": marker, "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
        for i, marker in enumerate(MARKERS)
    ]
    base["added_tokens"] += added
    (dest / "tokenizer.json").write_text(json.dumps(base))
    tokenizer_config = json.loads((dest / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = "<|end_turn|>"
    tokenizer_config.setdefault("added_tokens_decoder", {}).update(
        {str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in added}
    )
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (dest / "chat_template.jinja").write_text(TEMPLATE)
    return dest


@pytest.mark.asyncio
async def test_an_agent_of_a_model_with_added_chat_markers_resumes_after_a_restart(
    default_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = model_with_added_markers(tmp_path / "model", default_model_dir)
    config = SystemConfig(engine=EngineConfig(model=str(model_dir)), cache_dir=tmp_path / "cache")
    async with AgentSystem(config) as system:
        tokenizer = system.engine.model.tokenizer
        assert tokenizer.convert_tokens_to_ids(MARKERS[0]) >= tokenizer.vocab_size  # as in Qwen
        agent = await system.open("keeper", system_prompt="You are terse.")
        await agent.reply("Hello there.", max_tokens=4)
        await agent.reply("And again.", max_tokens=4)
        assert await agent.evict()  # its cache goes to disk too
        first_turns = agent.last_turn
    assert first_turns is not None

    async with AgentSystem(config) as system:
        agent = await system.open("keeper")
        await agent.reply("Once more.", max_tokens=4)
        persistence = system.models.persistence
        assert persistence is not None
        quarantined = list(persistence.quarantine_dir.glob("*"))

    assert quarantined == []
    assert agent.last_turn is not None and agent.last_turn.cache_tier == "disk"
    # The whole conversation came back: the prompt holds both earlier turns, reused from disk.
    assert agent.last_turn.num_cached_tokens >= first_turns.num_prompt_tokens
