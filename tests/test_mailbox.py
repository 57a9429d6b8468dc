"""The actors' ask/reply primitive (storage/mailbox.py) and a turn's one stream (its held Finished)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semantic.actors.request_stream import RequestStream
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import reply_to
from semantic.engine.loop.messages import EventChannel, Finished, FinishReason, GenerationRequest, TokenDelta
from semantic.storage.mailbox import Mailbox


class Full(RuntimeError):
    pass


class Closed(RuntimeError):
    pass


async def serve(mailbox: Mailbox[int], handled: list[int]) -> None:
    """A tiny actor: doubles each number, fails on negatives, and lives on either way."""
    while (envelope := await mailbox.get()) is not None:
        handled.append(envelope.message)
        await asyncio.sleep(0)
        if envelope.message < 0:
            reply_to(envelope.reply, error=ValueError(f"negative: {envelope.message}"))
        else:
            reply_to(envelope.reply, envelope.message * 2)


async def test_a_full_mailbox_refuses_an_ask_and_a_stop_past_the_bound_still_gets_in() -> None:
    mailbox: Mailbox[int] = Mailbox(2, Full)
    first, second = mailbox.ask(1), mailbox.ask(2)
    with pytest.raises(Full):
        mailbox.ask(3)
    past = mailbox.post(4)  # a delete or a stop always gets in
    assert len(mailbox) == 3
    handled: list[int] = []
    actor = asyncio.create_task(serve(mailbox, handled))
    assert await asyncio.gather(first, second, past) == [2, 4, 8]
    mailbox.close(Closed)
    await actor
    assert handled == [1, 2, 4]


async def test_close_fails_every_queued_ask_refuses_later_ones_and_ends_the_reader() -> None:
    mailbox: Mailbox[int] = Mailbox()
    queued = [mailbox.ask(n) for n in range(3)]
    mailbox.tell(9)  # a tell has no reply to fail
    mailbox.close(Closed)
    for reply in queued:
        with pytest.raises(Closed):
            await reply
    with pytest.raises(Closed):
        mailbox.ask(5)
    with pytest.raises(Closed):
        mailbox.tell(5)
    assert await mailbox.get() is None


async def test_close_wakes_a_reader_waiting_on_an_empty_mailbox() -> None:
    mailbox: Mailbox[int] = Mailbox()
    reader = asyncio.create_task(mailbox.get())
    await asyncio.sleep(0)
    mailbox.close(Closed)
    assert await reader is None


async def test_a_caller_that_left_does_not_break_the_actor_and_a_failure_goes_to_its_asker() -> None:
    mailbox: Mailbox[int] = Mailbox()
    handled: list[int] = []
    left, failing, after = mailbox.ask(1), mailbox.ask(-1), mailbox.ask(3)
    left.cancel()  # a client that disconnected
    actor = asyncio.create_task(serve(mailbox, handled))
    with pytest.raises(ValueError, match="negative"):
        await failing
    assert await after == 6
    assert handled == [1, -1, 3]
    mailbox.close(Closed)
    await actor


async def test_an_idle_timeout_on_get_loses_no_message() -> None:
    mailbox: Mailbox[int] = Mailbox()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await mailbox.get()
    reply = mailbox.ask(7)
    envelope = await mailbox.get()
    assert envelope is not None and envelope.message == 7 and envelope.reply is reply


async def test_take_removes_only_what_it_picks_and_keeps_the_order() -> None:
    mailbox: Mailbox[int] = Mailbox()
    replies = {n: mailbox.ask(n) for n in range(6)}
    taken = mailbox.take(lambda n: n % 2 == 0)
    assert [envelope.message for envelope in taken] == [0, 2, 4]
    assert [envelope.reply for envelope in taken] == [replies[0], replies[2], replies[4]]
    rest = [await mailbox.get() for _ in range(len(mailbox))]
    assert [envelope.message for envelope in rest if envelope is not None] == [1, 3, 5]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("ask"), st.integers(-3, 9)), st.just(("leave", 0)), st.just(("close", 0))
        ),
        max_size=30,
    ),
    st.integers(1, 4),
)
def test_every_ask_is_answered_failed_or_refused_whatever_the_order(
    steps: list[tuple[str, int]], capacity: int
) -> None:
    async def scenario() -> None:
        mailbox: Mailbox[int] = Mailbox(capacity, Full)
        handled: list[int] = []
        actor = asyncio.create_task(serve(mailbox, handled))
        asked: list[tuple[int, asyncio.Future[Any]]] = []
        for step, number in steps:
            if step == "ask":
                with contextlib.suppress(Full, Closed):
                    asked.append((number, mailbox.ask(number)))
            elif step == "leave" and asked:
                asked[-1][1].cancel()
            elif step == "close":
                mailbox.close(Closed)
            await asyncio.sleep(0)
        mailbox.close(Closed)
        await asyncio.wait_for(actor, 5)  # the actor ends: nothing it was handling broke it
        for number, reply in asked:
            assert reply.done()  # no caller waits for ever
            if reply.cancelled():
                continue
            if reply.exception() is None:
                assert reply.result() == number * 2
            else:
                assert isinstance(reply.exception(), Closed | ValueError)

    asyncio.run(scenario())


def held_stream() -> tuple[RequestStream, EventChannel, list[str]]:
    channel = EventChannel(asyncio.get_running_loop())
    cancelled: list[str] = []
    request = GenerationRequest("r", [1, 2], SamplingParams(max_tokens=1))
    stream = RequestStream(request, channel, cancelled.append)
    stream.hold_final()
    return stream, channel, cancelled


async def test_a_held_streams_reader_sees_finished_only_once_its_owner_finishes_it() -> None:
    stream, channel, _ = held_stream()
    final = Finished(FinishReason.STOP, None, 2, 0, 1)
    channel.put(TokenDelta([5], "hi"))
    channel.put(final)
    assert stream.done.result() is final  # the owner's signal to commit
    assert await stream.read() == TokenDelta([5], "hi")
    with pytest.raises(TimeoutError):  # a keep-alive's wait: the engine's Finished is not the reader's
        async with asyncio.timeout(0.05):
            await stream.read()
    assert stream.finished is None
    stream.finish(final)  # committed
    assert await stream.read() is final
    assert stream.finished is final


async def test_a_failed_commit_reaches_the_reader_instead_of_finished() -> None:
    stream, channel, _ = held_stream()
    channel.put(Finished(FinishReason.STOP, None, 2, 0, 1))
    stream.finish(OSError("disk full"))
    events: list[object] = []
    with pytest.raises(OSError, match="disk full"):
        async for event in stream:
            events.append(event)
    assert events == []


async def test_an_owner_may_finish_before_the_reader_reads_and_finished_comes_once() -> None:
    stream, channel, cancelled = held_stream()
    final = Finished(FinishReason.LENGTH, None, 2, 0, 1)
    channel.put(final)
    stream.finish(final)
    assert [event async for event in stream] == [final]
    assert cancelled == []  # a finished stream has no generation left to cancel
