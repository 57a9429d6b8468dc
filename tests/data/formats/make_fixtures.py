"""Write the format fixtures: a short conversation with a micro model (seeded random weights, the
default model's tokenizer) through a real `semantic serve` and its real writers, then copy the
agent's files and the identity they were written for. Run from the checkout whose formats they
record (`python tests/data/formats/make_fixtures.py DEST`); see README.md here."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess
from tests.tiny_models import write_random_model

MICRO_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 49152,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
AGENT_ID = "fixture"


def _post(base_url: str, path: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        f"{base_url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


def main(dest: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="semantic-fixtures-"))
    model = write_random_model(dict(MICRO_LLAMA), work / "micro-llama", ensure_default_model("float32"))
    server = ServerProcess(work / "cache", "--model", str(model)).start()
    try:
        _post(server.base_url, "/v1/agents", {"id": AGENT_ID, "system": "Be brief."})
        reply = _post(server.base_url, f"/v1/agents/{AGENT_ID}/messages", {"content": "Hi", "max_tokens": 3})
    finally:
        server.stop()
    (folder,) = (work / "cache" / "agents").iterdir()
    dest.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        shutil.copy(path, dest / path.name)
    (dest / "turn.json").write_text(json.dumps({"reply": reply, "model_config": MICRO_LLAMA}, indent=1))
    shutil.rmtree(work)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
