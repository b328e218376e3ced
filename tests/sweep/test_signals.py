"""Ctrl-C and SIGTERM as requests (sweep.signals), with real signals sent to this process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from sweep.signals import FORWARD, Preempted, graceful_signals, raise_pending, stop_requested


def deliver(signum: int) -> None:
    """Send `signum` to this process and give Python the moment it needs to run the handler."""
    os.kill(os.getpid(), signum)
    time.sleep(0.05)


def test_a_forwarded_request_then_the_direct_signal_is_still_one_request() -> None:
    """A scheduler signals every process of a task: a worker gets its launcher's forwarded SIGTERM and the SIGTERM
    itself, in either order. That is one request, honoured at the worker's next check, never "asked twice"."""
    for first, second in ((FORWARD[signal.SIGTERM], signal.SIGTERM), (signal.SIGTERM, FORWARD[signal.SIGTERM])):
        with graceful_signals():
            deliver(first)
            deliver(second)  # must not raise here
            assert stop_requested() is Preempted
            with pytest.raises(Preempted):
                raise_pending()
            raise_pending()  # once


def test_forwarded_requests_never_raise_at_once_and_a_second_direct_one_does() -> None:
    with graceful_signals():
        for _ in range(3):
            deliver(FORWARD[signal.SIGINT])
        assert stop_requested() is KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            raise_pending()
    with graceful_signals():
        deliver(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGINT)  # Ctrl-C twice: a worker stuck where no check comes stops now
    assert stop_requested() is None  # nothing outlives the block


def test_a_block_inside_another_leaves_the_requests_to_the_outer_one() -> None:
    # `sweep run` makes signals requests around `run_study`, which does so itself for callers from Python: the inner
    # block's end must neither put Python's handlers back nor forget a request the outer one still has to honour.
    with graceful_signals():
        with graceful_signals():
            deliver(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        assert stop_requested() is KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            raise_pending()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_stop_the_trial_s_own_handler_takes_is_heard_and_a_wakeup_fd_set_before_gets_every_byte() -> None:
    """`watched_handlers`: a SIGTERM that a handler of the trial's own takes in the worker's place is recorded as the
    request, raised at the next clean point, and the trial is known to handle signals itself; one the worker's own
    handler takes is recorded once, by it, and the trial is not taken for one that handles them. A wakeup fd set
    before the watch (another library's) still gets each byte; outside `graceful_signals` nothing is watched."""
    from sweep.signals import handled_by_trial, hear_taken, watched_handlers

    reader, writer = os.pipe()
    os.set_blocking(reader, False)
    os.set_blocking(writer, False)
    handler = signal.getsignal(signal.SIGTERM)
    before = signal.set_wakeup_fd(writer)
    try:
        with watched_handlers():  # outside graceful_signals: no watch, the fd set before stays
            assert signal.set_wakeup_fd(writer) == writer
        with graceful_signals():
            with watched_handlers():
                deliver(signal.SIGTERM)  # the worker's handler takes it
                hear_taken()
                assert stop_requested() is Preempted and not handled_by_trial()
            with pytest.raises(Preempted):
                raise_pending()
        assert os.read(reader, 64) == bytes([signal.SIGTERM])  # passed on to the fd set before
        with graceful_signals():
            with watched_handlers():
                signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the trial's own, which takes it
                deliver(signal.SIGTERM)
                assert stop_requested() is None  # the worker's handler never ran
            assert stop_requested() is Preempted and handled_by_trial()  # heard as the watch ended
            with pytest.raises(Preempted):
                raise_pending()
    finally:
        signal.set_wakeup_fd(before)
        signal.signal(signal.SIGTERM, handler)
        os.close(reader)
        os.close(writer)


def test_a_handler_of_the_trial_s_code_runs_after_sweep_s_bookkeeping_not_in_it() -> None:
    """`sheltered`: a Python handler a trial's code set (PyTorch's DataLoader sets one for SIGCHLD that raises in the
    main thread once a worker has died) runs when sweep's bookkeeping around it ends, not in the middle of it (CI: a
    preempted run hung inside the stopped trial's last report); each signal it missed comes once, none is dropped
    when a handler raises, and every handler is back as it was. The worker's own handler is left: it only records."""
    from sweep.signals import sheltered

    heard: list[int] = []

    def raising(signum: int, frame: object) -> None:
        heard.append(signum)
        if len(heard) == 1:  # the first raises, as PyTorch's does
            raise RuntimeError(f"signal {signum}")

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        signal.signal(signal.SIGUSR1, raising)
        signal.signal(signal.SIGUSR2, raising)
        with graceful_signals():
            with pytest.raises(RuntimeError, match="signal") as raised:
                with sheltered():
                    deliver(signal.SIGUSR2)
                    deliver(signal.SIGTERM)  # the worker's own handler: recorded at once, as ever
                    deliver(signal.SIGUSR1)
                    deliver(signal.SIGUSR2)
                    done = "the bookkeeping ran to its end"
                    assert heard == [] and stop_requested() is Preempted
            assert done and raised.value.__context__ is None  # raised at the block's end, in nothing of sweep's
            time.sleep(0.05)
            assert sorted(heard) == [signal.SIGUSR1, signal.SIGUSR2]  # each once: the other ran though one raised
            with pytest.raises(Preempted):
                raise_pending()
        assert signal.getsignal(signal.SIGUSR1) is raising and signal.getsignal(signal.SIGUSR2) is raising
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
