"""A small model that calls tools the way Claude Code expects: the default model plus a LoRA.

    python -m semantic.launch python scripts/make_tool_model.py [--out DIR]
    python -m semantic.launch python scripts/make_tool_model.py --train [--claude PATH]

Without `--train`, fuses the committed adapter (`tests/data/tool_model_adapter/`, mlx-lm's adapter
format: `adapters.safetensors` and `adapter_config.json`) into the default model, as `mlx_lm.fuse`
does, and saves the model directory beside the default model: `<models>/SmolLM2-135M-Instruct-tools`
(seconds). The directory names the adapter it was fused from (`ADAPTER_DIGEST_FILE`), so a new
adapter means a new build.

With `--train`, trains that adapter again (minutes), then fuses it:

1. Record (or reuse `tests/data/claude_code_sessions.json`, recorded this way and committed: a
   fresh recording differs in its temp paths and dates, and so does the model trained on it; one
   such build answered the test's sub-agent question wrongly where another answered it right):
   the real Claude Code CLI runs sub-agent round trips against a scripted model
   (`claude_code_recorder.py`): each session asks the main agent to have the `reader` sub-agent read
   a file and report its secret word, then says thanks. Files, words, paths and wordings differ
   per session.
2. Render each recorded request exactly as `semantic serve` renders it (the Anthropic edge's
   conversion, the model's chat template with Hermes-style tools) and the scripted reply as the
   assistant turn that follows; the loss is on the reply only.
3. Train a LoRA (mlx-lm's LoRA layers, `tool_model_training.py`) and save it as mlx-lm does.

The adapter is committed rather than trained on every machine: training took 4 minutes on 2 EPYC
cores and 9 on an Intel Xeon, and float32 training on two CPUs gives two slightly different models.
Nothing in it is hand-written output: the model learns the replies.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import hashlib
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load

from semantic.actors.prompting.chat_format import ChatFormat
from semantic.engine.model.default_model import (
    default_model_dir,
    ensure_default_model,
    is_converted,
    user_cache_dir,
)
from semantic.protocols.anthropic_wire import decode_request, to_chat_messages, tool_schemas

sys.path.insert(0, str(Path(__file__).parent))
from claude_code_recorder import Recorded, record
from tool_model_training import train_top_layers

TOOL_MODEL_NAME = "SmolLM2-135M-Instruct-tools"
TRAINED_LAYERS = 8
DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
RECORDED = DATA / "claude_code_sessions.json"
ADAPTER = DATA / "tool_model_adapter"
ADAPTER_DIGEST_FILE = "fused_adapter.sha256"
LORA_PARAMETERS = {"rank": 16, "scale": 20.0, "dropout": 0.0}
WORDS = [
    "apricot",
    "harbor",
    "velvet",
    "lantern",
    "quartz",
    "meadow",
    "copper",
    "falcon",
    "juniper",
    "pebble",
    "saffron",
    "thistle",
    "marble",
    "cobalt",
    "orchid",
    "walnut",
    "glacier",
    "ember",
    "willow",
    "tundra",
    "nectar",
    "basalt",
    "clover",
    "dune",
]
DIRS = ["work", "repo", "proj", "test", "src", "pytest", "session", "tmp", "data", "home"]
FILES = ["notes.txt", "todo.txt", "secret.txt", "memo.txt", "readme.txt", "log.txt", "plan.txt"]
ASKS = [
    "Use the reader agent to read {path} and tell me the secret word.",
    "Have the reader agent open {path}. What is the secret word?",
    "Ask a reader sub-agent what the secret word in {path} is.",
    "Send the reader agent to read {path} and report the secret word.",
]
THANKS = ["Thanks. Say done.", "Great, thank you. Reply with done.", "Thank you. Just say done."]


def sessions(root: Path, count: int, seed: int) -> list[tuple[Path, str, str]]:
    rng = random.Random(seed)
    made = []
    for index in range(count):
        depth = rng.randrange(1, 4)
        parts = [f"{rng.choice(DIRS)}{rng.choice(['', '-', '_'])}{rng.randrange(100)}" for _ in range(depth)]
        workdir = root.joinpath(*parts)
        workdir.mkdir(parents=True)
        path = workdir / FILES[index % len(FILES)]
        path.write_text(f"The secret word is {rng.choice(WORDS)}.\n")
        made.append((workdir, ASKS[index % len(ASKS)].format(path=path), THANKS[index % len(THANKS)]))
    return made


def recorded_sessions(claude: str, count: int, seed: int, keep: Path | None) -> list[Recorded]:
    if keep is not None and keep.exists():
        return [Recorded(**item) for item in json.loads(keep.read_text())]
    with tempfile.TemporaryDirectory(prefix="tool-model-") as root:
        recorded = asyncio.run(record(claude, sessions(Path(root), count, seed)))
    if keep is not None:
        keep.write_text(json.dumps([{"request": r.request, "reply": r.reply} for r in recorded]))
    return recorded


def example(chat: ChatFormat, recorded: Recorded) -> tuple[list[int], int]:
    """Token ids of the rendered request plus the scripted reply, and where the reply starts."""
    body = decode_request(json.dumps(recorded.request).encode())
    messages, tools = to_chat_messages(body), tool_schemas(body.tools)
    text = "".join(block.get("text", "") for block in recorded.reply)
    calls = [
        {"type": "function", "function": {"name": block["name"], "arguments": block["input"]}}
        for block in recorded.reply
        if block["type"] == "tool_use"
    ]
    reply: dict[str, Any] = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
    prompt = chat.encode(chat.render(messages, tools), None)
    whole = chat.encode(chat.render([*messages, reply], tools, add_generation_prompt=False), None)
    if whole[: len(prompt)] != prompt:
        raise RuntimeError("the rendered reply does not extend the rendered prompt token for token")
    return whole, len(prompt)


def train(base: Path, recorded: list[Recorded], adapter: Path, steps: int, seed: int) -> None:
    """Train the LoRA on the recorded sessions and save it in mlx-lm's adapter format."""
    model, tokenizer = load(str(base))[:2]  # loaded once: the tokenizer renders, the model trains
    chat = ChatFormat(tokenizer)
    examples = [example(chat, item) for item in recorded]
    print(f"{len(examples)} training examples", file=sys.stderr)
    mx.random.seed(seed)
    train_top_layers(
        model, examples, TRAINED_LAYERS, LORA_PARAMETERS, steps=steps, learning_rate=1e-4, seed=seed
    )
    save_adapter(model, adapter, TRAINED_LAYERS)


def save_adapter(model: Any, adapter: Path, num_layers: int) -> None:
    """The LoRA's weights and config as `mlx_lm.lora` saves them, which `mlx_lm.load` reads."""
    adapter.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": LORA_PARAMETERS}
    (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def adapter_digest(adapter: Path) -> str:
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapters.safetensors"):
        digest.update((adapter / name).read_bytes())
    return digest.hexdigest()


def is_fused_from(out: Path, adapter: Path) -> bool:
    """Whether `out` holds the default model fused with this very adapter."""
    marker = out / ADAPTER_DIGEST_FILE
    return is_converted(out) and marker.exists() and marker.read_text().strip() == adapter_digest(adapter)


def fuse(base: Path, adapter: Path, out: Path) -> None:
    """The base model with the adapter's LoRA layers fused into its weights (as `mlx_lm.fuse` does),
    saved beside the base model's own files (its tokenizer and chat template, unchanged)."""
    model = load(str(base), adapter_path=str(adapter))[0]
    fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
    model.update_modules(tree_unflatten(fused))
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(base, partial, ignore=shutil.ignore_patterns("*.safetensors"))
    mx.save_safetensors(str(partial / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (partial / ADAPTER_DIGEST_FILE).write_text(adapter_digest(adapter) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_model_dir().parent / TOOL_MODEL_NAME)
    parser.add_argument("--adapter", type=Path, default=ADAPTER, help="the adapter to fuse (and to train)")
    parser.add_argument("--train", action="store_true", help="train the adapter again first")
    parser.add_argument("--claude", default=str(user_cache_dir() / "claude-code/node_modules/.bin/claude"))
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--recorded",
        type=Path,
        default=RECORDED,
        help="keep the recorded sessions in this JSON file and reuse them (default: the committed "
        "recording, so every build trains on the same examples; name a new file to record afresh)",
    )
    args = parser.parse_args(argv)
    base = ensure_default_model("float32")
    if args.train:
        recorded = recorded_sessions(args.claude, args.sessions, args.seed, args.recorded)
        train(base, recorded, args.adapter, args.steps, args.seed)
    # One build at a time (parallel test workers may all ask for it): a later one finds it built.
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.parent / f".{args.out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if args.train or not is_fused_from(args.out, args.adapter):
            fuse(base, args.adapter, args.out)
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
