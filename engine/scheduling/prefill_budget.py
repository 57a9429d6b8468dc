"""How many prompt tokens one engine tick may prefill while other sequences decode.

mlx-lm's BatchGenerator interleaves on its own: each `next()` steps the decoding batch once and
then prefills one chunk of the waiting prompt. With a fixed chunk (512 tokens on the CPU) a
running stream waits for the whole chunk between two of its tokens, many times its decode step.
So the chunk is sized every tick instead.

A tick costs about D + c + n·p: one decode step D for the running batch, and a chunk of n prompt
tokens at p each on top of a fixed cost c (the chunk's own pass: launching its kernels, reading the
weights again where decode and chunk are two passes; near 0 where they share one, `mixed_step.py`).
With a stall ratio r the chunk may take r·D, so n = (r·D - c)/p holds a running stream's time
between tokens near (1 + r)·D. Where c alone takes more than half of that (a GPU, whose chunk of
any size costs about one launch-bound pass, ~ D), the chunk gets as long again as its fixed cost,
n = c/p: a chunk of 16 tokens would pay c for almost nothing, and a 2K-token arrival would wait
through a hundred such stalls (bench/results/cuda-h200/arrivals.json is this sizing on a GPU). D, c
and p are timed as the engine runs: D as a moving average of ticks that only decode (one for each
number of sequences decoding), c and p as a least-squares line through recent chunks' prefill times
(weighted towards the newest), so the budget follows the backend and the model. Until two chunk
sizes far enough apart have been seen, p is the last chunks' time per token with c taken as 0, and a
chunk that already overruns, or one about the size of the last, is doubled to find the line. With
nothing decoding, a prompt prefills in full chunks.

The line is trusted only near the sizes it was fitted on, and it lags costs that drift (a prompt's
later chunks attend over all it has prefilled, so its tokens get dearer as it goes):
- a chunk is at most 1.5 times the largest of the last few, so a slope fitted on chunks of 16-40
  tokens (short turns, noisy times) cannot send a 512-token chunk into a running stream's step;
- c counts as at most D when sizing the chunk: a chunk's fixed cost is at most one more pass over
  the weights, and a larger intercept is drift under the line, not a cost to amortise;
- a chunk that took over 1.1 times its aim shrinks the next in proportion;
- while chunks keep one size (no line can be fitted), p is refitted through their mean time with
  c kept, so a chunk whose ticks grow longer shrinks rather than keeping its size.
On a machine whose time per token doubles every 2K prompt tokens, the property test holds each
chunk within 2.5x its aim (tests/test_prefill_budget.py).

A short turn goes in whole chunks even while streams decode: a prompt whose uncached part is at
most `short_turn_tokens` (by default two chunks on the CPU, one on a GPU), a returning agent's turn
(its new messages on top of a cached history), costs the running streams one longer stall, where
small chunks would each pay a decode step and give half of each tick to the streams, and delay that
agent's reply about two-fold. Only longer prompts (cold histories, long documents) are chunked. A
short turn longer than a chunk takes as many ticks as whole chunks would, in chunks of one size: 520
tokens as two of 260, not 512 and 8, so its longest stall is half a chunk, not a whole one. Where to
draw the line is a trade, shown by the 8-agent replay on the CPU with short turns up to one chunk
(bench/results/agent_replay_cpu_8_short_turn_512.json) and up to two
(agent_replay_cpu_8_short_turn_1024_even.json): with two, the tool results go whole and the
returning turns' first tokens come sooner, but the streams' worst times between tokens grow (a whole
chunk over a long history is one long tick, and so are the ticks in which a sequence joins or leaves
the batch and every running cache is copied). An agent server waits on turns, so the CPU's default
is two chunks; a GPU's one chunk is 2,048 tokens already.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_CHUNK_TOKENS = 16  # below this a chunk's fixed costs swamp its tokens
SMOOTHING = 0.3  # weight of the newest observation in the moving averages
MIN_SPREAD = 0.1  # chunk sizes' deviation, over their mean, below which no line is fitted
TRUSTED_GROWTH = 1.5  # a chunk is at most this many times the largest of the last few
RECENT_CHUNKS = 8  # how many chunks "the last few" are
OVERRUN = 1.1  # a chunk whose prefill took more than this times its aim overran it


@dataclass(slots=True)
class _Line:
    """A least-squares line s = c + p·n through (n, s) points, older points weighing less."""

    weight: float = 0.0
    sum_n: float = 0.0
    sum_s: float = 0.0
    sum_nn: float = 0.0
    sum_ns: float = 0.0

    def add(self, n: float, s: float) -> None:
        keep = 1 - SMOOTHING
        self.weight = keep * self.weight + 1
        self.sum_n = keep * self.sum_n + n
        self.sum_s = keep * self.sum_s + s
        self.sum_nn = keep * self.sum_nn + n * n
        self.sum_ns = keep * self.sum_ns + n * s

    def means(self) -> tuple[float, float]:
        return self.sum_n / self.weight, self.sum_s / self.weight

    def fit(self) -> tuple[float, float] | None:
        """(c, p), or None while the points' sizes are too close together to tell c from p."""
        mean_n, mean_s = self.means()
        variance = self.sum_nn / self.weight - mean_n * mean_n
        if variance <= (MIN_SPREAD * mean_n) ** 2:
            return None
        slope = (self.sum_ns / self.weight - mean_n * mean_s) / variance
        # c stays between 0 and the mean time; the slope has a floor (`_least_token_s`).
        token_s = max(slope, _least_token_s(mean_n, mean_s))
        return min(max(mean_s - token_s * mean_n, 0.0), mean_s), token_s


@dataclass(slots=True)
class PrefillBudget:
    max_tokens: int  # the chunk with nothing decoding (`prefill_step_size`)
    stall_ratio: float  # r above; 0 turns the budget off (always `max_tokens`)
    short_turn_tokens: int  # a prompt with at most this many uncached tokens goes in whole chunks
    # D: a tick with decoding and no prefill, for each number of sequences decoding (a prompt that
    # joins the batch, or a stream that ends, must not leave the others' allowance stale)
    decode_steps: dict[int, float] = field(default_factory=dict)
    # Until a tick decodes alone, D is bounded by a tick that decoded and prefilled the floor: with
    # prompts queued behind a stream from the start (agents that arrive together), none might.
    _decode_bound_s: float | None = None
    fixed_s: float = 0.0  # c: a chunk's cost whatever its length (the last line fitted)
    token_s: float | None = None  # p: prefill time per prompt token (0 fixed cost until a line is fitted)
    _chunks: _Line = field(default_factory=_Line)
    _fitted: bool = False
    # the last few chunks: their tokens and prefill times, newest last
    _recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=RECENT_CHUNKS))

    def tokens_for_tick(self, num_decoding: int, num_prompt_tokens: int) -> int:
        """The chunk for the next tick, given how many sequences are decoding and the most uncached
        tokens any prompt now prefilling started with (0: none yet; a prompt admitted in the tick
        gets the budget's chunk unless it is short enough to go whole: `Batch.step`)."""
        if num_decoding == 0 or self.stall_ratio <= 0 or self.max_tokens <= MIN_CHUNK_TOKENS:
            return self.max_tokens
        if 0 < num_prompt_tokens <= self.short_turn_tokens:  # a short turn: whole chunks
            return self.short_turn_chunk(num_prompt_tokens)
        decode_s = self.decode_step_s(num_decoding)
        if decode_s is None or self.token_s is None:
            return MIN_CHUNK_TOKENS  # measure with a small chunk before risking a long stall
        allowed_s = self.stall_ratio * decode_s
        if self._fitted:
            # A chunk's fixed cost is at most one more pass over the weights, about a decode step; a
            # larger intercept is costs drifting up under the line (a prompt's later chunks attend
            # over more), not a cost to amortise with a longer chunk.
            fixed_s = min(self.fixed_s, decode_s)
            tokens = _tokens_in(max(allowed_s - self.fixed_s, fixed_s), self.token_s)
            # The line lags costs that drift; a chunk that overran its aim shrinks in proportion.
            aim_s = max(allowed_s, self.fixed_s + fixed_s)
            last_tokens, last_s = self._recent[-1]
            if last_s > OVERRUN * aim_s:
                tokens = min(tokens, last_tokens * aim_s / last_s)
        else:
            mean_n, mean_s = self._chunks.means()
            tokens = _tokens_in(allowed_s, self.token_s)
            # A chunk that overruns may be mostly fixed cost, and one near the sizes seen teaches
            # nothing: double it, once, to find the line.
            if mean_s > allowed_s or abs(tokens - mean_n) <= 2 * MIN_SPREAD * mean_n:
                tokens = 2 * mean_n
        tokens = min(tokens, TRUSTED_GROWTH * max(n for n, _ in self._recent))
        return int(max(MIN_CHUNK_TOKENS, min(self.max_tokens, tokens)))

    def observe(self, elapsed_s: float, num_decoding: int, num_prompt_tokens: int) -> None:
        """Record one tick: its wall time, how many sequences decoded, how many prompt tokens it prefilled."""
        if elapsed_s <= 0:
            return
        if num_prompt_tokens == 0:
            if num_decoding:
                self.decode_steps[num_decoding] = _average(self.decode_steps.get(num_decoding), elapsed_s)
            return
        if num_decoding and num_prompt_tokens <= MIN_CHUNK_TOKENS:
            # Only a tick that prefilled the floor bounds D: one that took a short turn whole beside
            # the stream is mostly prefill, and as D it allows chunks as long as itself.
            bound_s = self._decode_bound_s
            self._decode_bound_s = elapsed_s if bound_s is None else min(bound_s, elapsed_s)
        decode_s = (self.decode_step_s(num_decoding) or 0.0) if num_decoding else 0.0
        # The decode share is an estimate; never let it leave less than a tenth of the tick to prefill.
        prefill_s = max(elapsed_s - decode_s, elapsed_s / 10)
        self._chunks.add(num_prompt_tokens, prefill_s)
        self._recent.append((num_prompt_tokens, prefill_s))
        line = self._chunks.fit()
        mean_n, mean_s = self._chunks.means()
        if line is not None:
            self.fixed_s, self.token_s = line
            self._fitted = True
        elif self._fitted:  # one size lately: the line through their mean, c kept where it can be
            if self.fixed_s >= mean_s:
                self.fixed_s = mean_s / 2
            self.token_s = max((mean_s - self.fixed_s) / mean_n, _least_token_s(mean_n, mean_s))
        else:
            self.token_s = mean_s / mean_n

    def whole_for_short_turns(self, chunk: int, prefilling: list[int]) -> int:
        """The chunk for prompts about to prefill together (their uncached tokens), once they are
        known: a short turn's chunk where every one is a short turn, as `tokens_for_tick` has them,
        else `chunk`."""
        if prefilling and max(prefilling) <= self.short_turn_tokens:
            return max(chunk, self.short_turn_chunk(max(prefilling)))
        return chunk

    def short_turn_chunk(self, num_prompt_tokens: int) -> int:
        """A short turn's chunk: its tokens in as many ticks as whole chunks take, in chunks of one
        size (520 tokens as two of 260, not 512 and 8), so that no tick stalls the streams longer
        than that many ticks need."""
        if num_prompt_tokens <= self.max_tokens:
            return self.max_tokens
        num_ticks = -(-num_prompt_tokens // self.max_tokens)
        return -(-num_prompt_tokens // num_ticks)

    def decode_step_s(self, num_decoding: int) -> float | None:
        """D for `num_decoding` sequences: as measured, else as measured for the nearest number, else
        the bound from a tick that also prefilled."""
        if not self.decode_steps:
            return self._decode_bound_s
        nearest = min(self.decode_steps, key=lambda n: (abs(n - num_decoding), n))
        return self.decode_steps[nearest]


def per_prompt_chunk(tokens: int, num_prompts: int, max_tokens: int) -> int:
    """A tick's prefill budget as mlx-lm's per-prompt chunk, for `num_prompts` prompts prefilled
    together (on a GPU, up to 8): whole chunks stay whole; a budget held down for streams that
    decode is shared, so that the tick prefills it once, not once for each prompt."""
    if tokens >= max_tokens or num_prompts <= 1:
        return tokens
    return max(MIN_CHUNK_TOKENS, tokens // num_prompts)


def _least_token_s(mean_n: float, mean_s: float) -> float:
    """Noise can tilt a fitted line flat or backwards: a token never costs less than a twentieth of
    the mean time per token."""
    return mean_s / mean_n / 20


def _tokens_in(seconds: float, token_s: float) -> float:
    return seconds / token_s if token_s > 0 else float("inf")


def _average(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - SMOOTHING) * previous + SMOOTHING * value
