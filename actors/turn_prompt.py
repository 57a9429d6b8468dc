"""A turn's prompt and engine request: rendered, tokenized, bounded and, where the turn constrains
its output, given a compiled grammar, all in one tokenizer job (with the turn's cache explanation,
`cache_notes.explainer`); then given the model's sampling defaults on the event loop."""

from __future__ import annotations

from loguru import logger
from msgspec.structs import replace

from semantic.actors.cache_notes import Explainer, Explanation
from semantic.actors.heap import give_memory_back
from semantic.actors.model_session import ModelSession
from semantic.actors.models import ModelHost
from semantic.actors.prompting.prompt_pins import block_aligned
from semantic.actors.turns import (
    OutputGrammar,
    PreparedPrompt,
    PromptBound,
    PromptLimitError,
    TurnRequest,
    prepare_continuation,
    prepare_stateless,
)
from semantic.engine.decoding.grammar_matcher import GrammarCompiler, GrammarError, GrammarMatcher
from semantic.engine.loop.messages import GenerationRequest
from semantic.storage.conversation_file import ConversationRecord

LARGE_PROMPT_TOKENS = 100_000  # past this, the tokenizer's memory is handed back after each prompt

Prepared = tuple[PreparedPrompt, GrammarMatcher | None, Explanation | None]


async def build_request(
    models: ModelHost,
    session: ModelSession,
    conversation: ConversationRecord | None,
    turn: TurnRequest,
    max_prompt_tokens: int | None,
    explainer: Explainer | None = None,
) -> tuple[PreparedPrompt, GenerationRequest, Explanation | None]:
    """The prompt (continuing `conversation` when the agent keeps one), its engine request and
    `explainer`'s explanation of it, from one tokenizer job; raises PromptLimitError past
    `max_prompt_tokens` after handing the tokenizer's memory back."""
    loaded = session.loaded
    turn.sampling.check_token_ids(loaded.num_token_ids)
    ids = turn.prompt_token_ids
    if ids and not 0 <= min(ids) <= max(ids) < loaded.num_token_ids:
        raise ValueError(f"prompt: the model's token ids are 0 to {loaded.num_token_ids - 1}")
    bound = PromptBound.of(loaded, max_prompt_tokens)
    prompt, grammar, explained = await models.in_tokenizer_worker(
        prepare_in_worker, session, conversation, turn, bound, explainer
    )
    sampling = turn.sampling.with_defaults(loaded.generation_defaults)
    # A forced call ends at its closer. Under a grammar the grammar writes the closer and then allows
    # only the end of the reply; a stop string would also fire on the closer inside a string argument.
    if prompt.stop_after_call and prompt.grammar is None and prompt.stop_after_call not in sampling.stop:
        sampling = replace(sampling, stop=(*sampling.stop, prompt.stop_after_call))
    request = GenerationRequest(
        turn.request_id,
        prompt.token_ids,
        sampling,
        model_fingerprint=loaded.fingerprint,
        cache_salt=turn.cache_salt,
        grammar=grammar,
        continues_text=prompt.is_raw or bool(turn.prefill),
        shared_head_tokens=prompt.shared_head_tokens,
        generation_prompt_start=prompt.generation_prompt_start,
        cache_pins=block_aligned(prompt.cache_pins, loaded.spec.block_size),
    )
    return prompt, request, explained


def prepare_in_worker(
    session: ModelSession,
    conversation: ConversationRecord | None,
    turn: TurnRequest,
    bound: PromptBound,
    explainer: Explainer | None,
) -> Prepared:
    """Tokenizer worker: the turn's prompt, bounded, its grammar's matcher and `explainer`'s
    explanation of its token ids, so that a turn waits on the workers once."""
    chat, max_prompt_tokens = session.chat, bound.max_prompt_tokens
    if conversation is not None:
        history, system = conversation.token_ids, conversation.system
        prompt = prepare_continuation(chat, history, system, turn, bound)
    else:
        prompt = prepare_stateless(chat, turn, bound)
    num_tokens = len(prompt.token_ids)
    if max_prompt_tokens is not None and num_tokens > max_prompt_tokens:
        del prompt
        give_memory_back()  # what tokenizing it took, back to the OS
        raise PromptLimitError(num_tokens, max_prompt_tokens)
    if num_tokens >= LARGE_PROMPT_TOKENS:
        give_memory_back()
    grammar = prompt.grammar
    matcher = _compile(session.grammars, grammar, turn.cache_salt) if grammar is not None else None
    explained = explainer(prompt.token_ids) if explainer is not None else None
    return prompt, matcher, explained


def _compile(
    grammars: GrammarCompiler, grammar: OutputGrammar, cache_salt: str | None
) -> GrammarMatcher | None:
    """The grammar's matcher, or its fallback's where llguidance refuses guidance the server chose."""
    try:
        return grammars.matcher(grammar.grammar, grammar.trigger, cache_salt)
    except GrammarError as error:
        if grammar.fallback is None and not grammar.is_optional:
            raise
        fallback = "looser" if grammar.fallback is not None else "none"
        logger.warning(
            "tool calls: guidance by the tools' schemas refused ({}); guidance: {}", error, fallback
        )
        if grammar.fallback is None:
            return None
        return _compile(grammars, grammar.fallback, cache_salt)
