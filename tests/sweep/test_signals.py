"""Ctrl-C and SIGTERM as requests (sweep.signals), with real signals sent to this process."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

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
    preempted run hung inside the stopped trial's last report): each handler whose signal came, once, in the order
    they came, with the frame it came in, none skipped when one raises, and every handler is back as it was. The
    worker's own handler is left: it only records. Timers pass through: a timeout's SIGALRM interrupts a hung write."""
    from sweep.signals import sheltered

    heard: list[int] = []
    frames: list[str] = []

    def raising(signum: int, frame: Any) -> None:
        heard.append(signum)
        frames.append(frame.f_code.co_name)
        if len(heard) == 1:  # the first raises, as PyTorch's does
            raise RuntimeError(f"signal {signum}")

    signums = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
    before = {signum: signal.getsignal(signum) for signum in signums}
    try:
        for signum in signums:
            signal.signal(signum, raising)
        with graceful_signals():
            with pytest.raises(RuntimeError, match=f"signal {signal.SIGUSR2}") as raised:
                with sheltered():
                    deliver(signal.SIGUSR2)
                    deliver(signal.SIGTERM)  # the worker's own handler: recorded at once, as ever
                    deliver(signal.SIGUSR1)
                    deliver(signal.SIGUSR2)
                    done = "the bookkeeping ran to its end"
                    assert heard == [] and stop_requested() is Preempted
            assert done and heard == [signal.SIGUSR2, signal.SIGUSR1]  # both ran, in order, before it came out
            assert frames == ["deliver", "deliver"] and raised.value.__context__ is None  # where each came
            with pytest.raises(Preempted):
                raise_pending()
            with pytest.raises(RuntimeError, match=f"signal {signal.SIGALRM}"), sheltered():
                heard.clear()
                deliver(signal.SIGALRM)  # not deferred
                pytest.fail("SIGALRM was deferred")
        assert all(signal.getsignal(signum) is raising for signum in signums)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_handler_that_raises_while_handlers_are_swapped_or_put_back_leaves_none_swapped() -> None:
    """Review: setting a handler first runs the handlers pending, and one that raises there (PyTorch's, at a second
    worker's SIGCHLD) left the stub that notes signals installed for good, the signals it had noted never delivered.
    The raise is planted at each call that sets a handler, on the way in and on the way back."""
    import _signal
    import sys

    from sweep.signals import sheltered

    counts: dict[int, int] = {}

    def counting(signum: int, frame: object) -> None:
        counts[signum] = counts.get(signum, 0) + 1

    def raising(signum: int, frame: object) -> None:
        counts[signum] = counts.get(signum, 0) + 1
        raise RuntimeError("a worker died")

    handlers = {signal.SIGHUP: counting, signal.SIGUSR1: raising, signal.SIGUSR2: counting}
    before = {signum: signal.getsignal(signum) for signum in handlers}
    try:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for planted in range(1, 8):  # 3 handlers swapped in, 3 put back (and set again), then none planted
            counts.clear()
            calls, ran = [0], False

            def profile(frame: object, event: str, arg: object, planted: int = planted,
                        calls: list[int] = calls) -> None:
                if event == "c_call" and arg is _signal.signal:
                    calls[0] += 1
                    if calls[0] == planted:
                        signal.raise_signal(signal.SIGUSR1)

            with graceful_signals():
                try:
                    sys.setprofile(profile)
                    with sheltered():
                        ran = True
                        signal.raise_signal(signal.SIGUSR2)
                except RuntimeError:
                    pass
                finally:
                    sys.setprofile(None)
            assert {signum: signal.getsignal(signum) for signum in handlers} == handlers, planted
            assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set(), planted
            assert counts.get(signal.SIGUSR1, 0) == (1 if planted <= calls[0] else 0), (planted, counts)
            assert counts.get(signal.SIGUSR2, 0) == (1 if ran else 0), (planted, counts)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


@pytest.mark.parametrize("healed_by", ["the next shelter", "the trial's end"])
def test_what_a_second_ctrl_c_cuts_short_as_handlers_are_put_back_is_put_back_later(healed_by: str) -> None:
    """Review: a handler `sheltered` does not defer (a second Ctrl-C raises at once; a timer's) raising while the
    others were put back left the noting stub on them for the process's life, their signals swallowed. What it
    left is put back as the next `sheltered` ends (the noted handler then called once) or as the trial's code
    ends."""
    import sys

    from sweep.signals import sheltered, trial_code

    calls: list[int] = []

    def requeue(signum: int, frame: object) -> None:  # Lightning's SIGUSR1, say
        calls.append(signum)

    before = signal.getsignal(signal.SIGUSR1)
    tearing = [False]

    def profile(frame: Any, event: str, arg: object) -> None:
        if tearing[0] and event == "c_call" and arg is iter and frame.f_code.co_name == "_put_back":
            tearing[0] = False
            signal.raise_signal(signal.SIGINT)  # the second Ctrl-C, as the handlers are put back

    try:
        signal.signal(signal.SIGUSR1, requeue)
        with graceful_signals(), pytest.raises(KeyboardInterrupt):
            with trial_code():
                deliver(signal.SIGINT)  # the first: a request
                with pytest.raises(KeyboardInterrupt):
                    try:
                        sys.setprofile(profile)
                        with sheltered():
                            deliver(signal.SIGUSR1)
                            tearing[0] = True
                    finally:
                        sys.setprofile(None)
                assert signal.getsignal(signal.SIGUSR1) is not requeue and calls == []  # cut short
                if healed_by == "the next shelter":
                    with sheltered():
                        pass
                    assert signal.getsignal(signal.SIGUSR1) is requeue and calls == [signal.SIGUSR1]
                raise KeyboardInterrupt  # the trial stops
        assert signal.getsignal(signal.SIGUSR1) is requeue  # back, as the trial's code ended
        assert calls == ([signal.SIGUSR1] if healed_by == "the next shelter" else [])
        deliver(signal.SIGUSR1)
        assert calls[-1:] == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_putting_handlers_back_loses_no_pending_handler_s_error_and_survives_a_shelter_inside_a_handler() -> None:
    """Review: as the trial's code ended, what a pending handler raised while a cut-short shelter's handlers were put
    back (a timeout's SIGALRM) was dropped; and a handler run meanwhile that took a shelter of its own (a requeue
    handler that saves a checkpoint) put the others back itself, and the put-back then raised KeyError."""
    import sys

    from sweep import signals
    from sweep.signals import sheltered

    class Timeout(Exception):
        pass

    def timeout(signum: int, frame: object) -> None:
        raise Timeout

    saved: list[int] = []

    def saving(signum: int, frame: object) -> None:  # Slurm's requeue signal: save, through sweep's registration
        with sheltered():
            saved.append(signum)

    def plant(signum: int, *, at: object, within: str, nth: int = 1) -> Any:
        """A profile function that raises `signum` at the `nth` call of the C function `at` from a `within` frame."""
        calls = [0]

        def profile(frame: Any, event: str, arg: object) -> None:
            if event == "c_call" and arg is at and frame.f_code.co_name == within:
                calls[0] += 1
                if calls[0] == nth:
                    signal.raise_signal(signum)
        return profile

    import _signal

    signums = (signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2)
    before = {signum: signal.getsignal(signum) for signum in signums}
    try:
        signal.signal(signal.SIGALRM, timeout)
        signal.signal(signal.SIGUSR1, saving)
        signal.signal(signal.SIGUSR2, saving)
        # What a cut-short shelter leaves: SIGUSR1 held, its stub installed.
        signals._held[signal.SIGUSR1] = saving
        signal.signal(signal.SIGUSR1, signals._note)
        sys.setprofile(plant(signal.SIGALRM, at=_signal.getsignal, within="_put_back"))
        try:
            with pytest.raises(Timeout):
                signals._trial_handlers_ended()
        finally:
            sys.setprofile(None)
        assert signal.getsignal(signal.SIGUSR1) is saving and not signals._held and not signals._sheltering
        # Two held; the first, put back, runs (a real SIGUSR1) as the second is put back, with a shelter of its own.
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            signals._held[signum] = saving
            signal.signal(signum, signals._note)
        sys.setprofile(plant(signal.SIGUSR1, at=_signal.signal, within="signal", nth=2))
        try:
            signals._trial_handlers_ended()
        finally:
            sys.setprofile(None)
        assert saved == [signal.SIGUSR1] and not signals._held
        assert signal.getsignal(signal.SIGUSR1) is saving and signal.getsignal(signal.SIGUSR2) is saving
    finally:
        signals._held.clear()
        signals._heard.clear()
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_launcher_kills_the_workers_still_running_after_its_grace_and_says_which() -> None:
    """PostgreSQL review: workers that had not ended within the launcher's grace were killed without a word, and its
    last line said their lines above told what became of their trials (none came). `_stop` returns the killed ones,
    which the launcher's last line names."""
    import subprocess
    import sys

    from sweep.workers import _stop

    deaf = ("import signal, sys, time\n"
            f"signal.signal({int(FORWARD[signal.SIGTERM])}, signal.SIG_IGN)\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    quick = "import sys\nprint('ready', flush=True)\nsys.stdin.read()\n"  # ends at once on the forwarded signal
    processes = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                 for code in (quick, deaf)]
    try:
        for process in processes:
            assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        assert _stop(processes, 2.0, signal.SIGTERM) == [1]
        assert processes[1].returncode == -signal.SIGKILL and processes[0].returncode != -signal.SIGKILL
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
