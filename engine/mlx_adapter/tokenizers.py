"""mlx-lm's tokenizer internals that semantic reads: the byte-level BPE byte map (GPT-2's
`bytes_to_unicode`, inverted), which `token_logprobs` uses to give a token's raw bytes when its
text ends inside a UTF-8 character.

Written against mlx-lm 0.32.2, whose `tokenizer_utils._byte_decoder` is private: read through
`byte_decoder()` here, with a check at load that it still maps one character to each of the 256
byte values.
"""

from __future__ import annotations

from mlx_lm.tokenizer_utils import _byte_decoder

from semantic.engine.mlx_adapter.seam_check import require


def byte_decoder() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: a vocabulary piece's characters to bytes."""
    decoder: dict[str, int] = _byte_decoder()
    return decoder


def check_tokenizer_seams() -> None:
    require(
        "mlx_lm.tokenizer_utils._byte_decoder() maps 256 characters one to one onto the bytes 0-255 "
        "(token_logprobs reads a byte-level token's bytes with it)",
        lambda: sorted(byte_decoder().values()) == list(range(256)) and byte_decoder()["Ġ"] == 0x20,
    )
