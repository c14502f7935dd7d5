"""``router.busy_poll.BusyPoll`` on a real event loop: it polls for its window after each kick,
counts the seconds it polled, and stops for good when closed."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.busy_poll import BusyPoll


async def test_a_kick_polls_for_its_window_then_the_loop_sleeps():
    counted: list[float] = []
    busy = BusyPoll(0.2, counted.append)
    cpu = time.process_time()
    busy.kick()
    assert busy.polling
    await asyncio.sleep(0.1)
    busy.kick()  # half way: the window starts again from here
    await asyncio.sleep(0.15)
    assert busy.polling  # 0.25 s after the first kick: the second one's window still runs
    await asyncio.sleep(0.1)
    assert not busy.polling
    polled_cpu = time.process_time() - cpu
    assert 0.29 <= sum(counted) <= 0.45, counted  # first kick to 0.2 s after the second (0.3 s)
    assert polled_cpu >= 0.1, polled_cpu  # it ran (sleeping, a loop uses next to no CPU)
    cpu = time.process_time()
    await asyncio.sleep(0.2)
    assert time.process_time() - cpu < 0.05  # idle: the loop sleeps again


async def test_count_now_counts_the_polling_so_far():
    counted: list[float] = []
    busy = BusyPoll(0.5, counted.append)
    busy.count_now()
    assert counted == []  # not polling: nothing to count
    busy.kick()
    await asyncio.sleep(0.1)
    busy.count_now()  # as a scrape does mid-window
    assert 0.09 <= sum(counted) < 0.3 and busy.polling, counted
    await asyncio.sleep(0.5)
    assert not busy.polling and 0.49 <= sum(counted) < 0.75, counted  # each stretch counted once


async def test_a_closed_poll_stops_at_once_and_is_not_kicked_again():
    counted: list[float] = []
    busy = BusyPoll(5.0, counted.append)
    busy.kick()
    await asyncio.sleep(0.05)
    busy.close()
    await asyncio.sleep(0.01)
    assert not busy.polling and sum(counted) < 1.0
    busy.kick()
    assert not busy.polling


@pytest.mark.parametrize("window", [0.0, -1.0, float("nan")])
def test_a_window_must_be_positive(window):
    with pytest.raises(ValueError, match="busy poll window must be > 0 seconds"):
        BusyPoll(window)
