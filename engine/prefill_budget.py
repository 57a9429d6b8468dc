"""How many prompt tokens one engine tick may prefill while other sequences decode.

mlx-lm's BatchGenerator interleaves on its own: each `next()` steps the decoding batch once and
then prefills one chunk of the waiting prompt. With a fixed chunk (512 tokens on the CPU) a
running stream waits for the whole chunk between two of its tokens: ~2 s here, 30 times its
decode step. So the chunk is sized every tick instead.

A tick costs about D + n·p: one decode step D for the running batch and n prompt tokens at p each.
With a stall ratio r, n = r·D/p holds a running stream's time between tokens near (1 + r)·D.
D and p are measured as the engine runs (moving averages), so the budget follows the backend and
the model: a GPU, whose prefill is cheap next to its decode step, gets big chunks; a CPU small
ones. p is measured at the chunk size in use, per-chunk overheads included, so the estimate
settles where a chunk really takes r·D: where decode and chunk share one forward pass
(`mixed_step.py`) p is the tokens' marginal cost, and where they are two passes it includes the
chunk's own read of the weights. With nothing decoding, a prompt prefills in full chunks.

A prompt whose uncached part fits one chunk goes in whole even while streams decode: a returning
agent's turn (its new messages on top of a cached history) costs the running streams one longer
stall, where small chunks would each pay a decode step and the model's weights read again, and
delay that agent's reply several-fold on the CPU. Only long prompts (cold histories) are chunked.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CHUNK_TOKENS = 16  # below this a chunk's fixed costs swamp its tokens
SMOOTHING = 0.3  # weight of the newest observation in the moving averages


@dataclass(slots=True)
class PrefillBudget:
    max_tokens: int  # the chunk with nothing decoding (`prefill_step_size`)
    stall_ratio: float  # r above; 0 turns the budget off (always `max_tokens`)
    decode_step_s: float | None = None  # D: a tick with decoding and no prefill
    token_s: float | None = None  # p: prefill time per prompt token, at the chunk size in use

    def tokens_for_tick(self, num_decoding: int, num_prompt_tokens: int) -> int:
        """The chunk for the next tick, given how many sequences are decoding and the most uncached
        tokens any prompt now prefilling started with (0: none yet; one admitted in the tick gets
        the budget's chunk, as its length is not known when the chunk is chosen)."""
        if num_decoding == 0 or self.stall_ratio <= 0 or self.max_tokens <= MIN_CHUNK_TOKENS:
            return self.max_tokens
        if 0 < num_prompt_tokens <= self.max_tokens:  # a short turn: whole, in one stall
            return self.max_tokens
        if self.decode_step_s is None or self.token_s is None:
            return MIN_CHUNK_TOKENS  # measure with a small chunk before risking a long stall
        tokens = int(self.stall_ratio * self.decode_step_s / self.token_s)
        return max(MIN_CHUNK_TOKENS, min(self.max_tokens, tokens))

    def observe(self, elapsed_s: float, num_decoding: int, num_prompt_tokens: int) -> None:
        """Record one tick: its wall time, how many sequences decoded, how many prompt tokens it prefilled."""
        if elapsed_s <= 0:
            return
        if num_prompt_tokens == 0:
            if num_decoding:
                self.decode_step_s = _average(self.decode_step_s, elapsed_s)
            return
        decode_s = (self.decode_step_s or 0.0) if num_decoding else 0.0
        # The decode share is an estimate; never let it leave less than a tenth of the tick to prefill.
        prefill_s = max(elapsed_s - decode_s, elapsed_s / 10)
        self.token_s = _average(self.token_s, prefill_s / num_prompt_tokens)


def _average(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - SMOOTHING) * previous + SMOOTHING * value
