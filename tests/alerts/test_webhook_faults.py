"""Alert delivery under faults, against local servers that refuse, hang and trickle.

Every failed delivery is counted (``WebhookSender.failures``; the engine's ``action_failures``), warned once
and never silent, whatever the wiring; one attempt ends within its ``timeout`` in total, a server that
answers one byte at a time included; ``close`` waits at most :data:`CLOSE_TIMEOUT` (2 s) in all; the sender never
holds the interpreter's exit; an action that raises anything loses neither the alert's record nor the
other actions.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from headwatch.alerts import Alert, AlertEngine, CollapseRules, WebhookSender
from headwatch.alerts.webhook import CLOSE_TIMEOUT

E = "headwatch/logits/entropy"


def alert(step: int = 0) -> Alert:
    return Alert(time="t", step=step, epoch=0, rule="entropy_floor", metrics={}, message="m")


class Server:
    """A local TCP server: ``mode`` "hang" (reads the request, never answers) or "trickle" (answers one byte
    every ``gap`` seconds, forever)."""

    def __init__(self, mode: str, gap: float = 0.2) -> None:
        self.mode, self.gap = mode, gap
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.connections = 0
        threading.Thread(target=self.serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/SECRET"

    def serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            if self.mode == "trickle":
                for byte in b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Pad: " + b"x" * 10_000:
                    if self.stop.is_set():
                        break
                    conn.send(bytes([byte]))
                    time.sleep(self.gap)
            else:
                self.stop.wait(60)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("mode", ["hang", "trickle"])
def test_one_attempt_ends_within_its_timeout(mode):
    server = Server(mode)
    failures = []
    try:
        sender = WebhookSender(server.url, timeout=1.0, retries=0, on_failure=lambda what, err: failures.append(str(err)))
        start = time.monotonic()
        sender(alert())
        assert sender.flush(timeout=5.0)
        took = time.monotonic() - start
    finally:
        server.close()
    assert took < 1.0 + 0.5, f"{mode}: one attempt took {took:.2f} s against a timeout of 1 s"
    assert sender.failures == 1 and sender.sent == 0 and len(failures) == 1
    assert "within 1 s" in failures[0] or "timed out" in failures[0], failures


def test_close_is_bounded_and_counts_every_alert_it_abandons():
    server = Server("hang")
    try:
        sender = WebhookSender(server.url, timeout=2.0, retries=5)  # 16.75 s per alert at most
        assert sender.per_alert_seconds == pytest.approx(6 * 2.0 + 0.25 + 0.5 + 1.0 + 1.0 + 1.0)
        for step in range(5):
            sender(alert(step))
        start = time.monotonic()
        sender.close(timeout=1.0)
        took = time.monotonic() - start
        assert took < 1.0 + 0.5
        assert sender.failures == 5  # queued ones and the one in flight abandoned at close, counted once each
        assert [a.step for a in sender.undelivered] == [0, 1, 2, 3, 4]
        time.sleep(2.5)  # the post in flight ends by its own deadline: not counted again
        assert sender.failures == 5 and sender.sent == 0
    finally:
        server.close()


def test_the_default_close_bound_is_two_seconds():
    assert CLOSE_TIMEOUT == 2.0


def test_a_failed_delivery_is_counted_and_warned_once_whatever_the_wiring():
    """A sender without ``on_failure`` added to an engine by hand (the README's wiring): the engine wires it."""
    warned: list[str] = []
    engine = AlertEngine(CollapseRules(entropy_floor=1.0), [], warn=warned.append)
    url = f"http://127.0.0.1:{closed_port()}/x/SECRET"
    engine.actions.append(WebhookSender(url, timeout=0.5, retries=0))
    engine.observe_train(0, {E: 0.5})
    engine.observe_train(1, {E: 1.5})  # resolved
    engine.observe_train(2, {E: 0.5})  # fires again
    engine.close()
    webhook_warnings = [m for m in warned if "webhook" in m]
    assert engine.action_failures == 2 and len(webhook_warnings) == 1
    assert "SECRET" not in webhook_warnings[0]


def test_the_sender_never_holds_the_interpreters_exit():
    server = Server("hang")
    code = (
        "import time; from headwatch.alerts import Alert, WebhookSender\n"
        f"s = WebhookSender({server.url!r}, timeout=2.0, retries=5)\n"
        "for i in range(3): s(Alert(time='t', step=i, epoch=0, rule='r', metrics={}, message='m'))\n"
        "time.sleep(0.5)\n"
        "start = time.monotonic()\n"
        "print('queued', flush=True)\n"
    )
    try:
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        took = time.monotonic() - start
    finally:
        server.close()
    assert out.returncode == 0 and "queued" in out.stdout, out.stderr
    # 3 alerts x 6 attempts x 2 s would hold a non-daemon thread for ~50 s; the import of torch takes a few
    assert took < 30, f"the interpreter took {took:.1f} s to exit"


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


class Odd(BaseException):
    pass


@pytest.mark.parametrize("raised", [Unprintable(), Odd("odd"), ValueError("plain")])
def test_an_action_that_raises_anything_loses_no_record_and_no_other_action(raised):
    ran: list[int] = []
    warned: list[str] = []

    def bad(a: Alert) -> None:
        raise raised

    engine = AlertEngine(CollapseRules(entropy_floor=1.0), [bad, lambda a: ran.append(a.step)], warn=warned.append)
    for step in range(6):  # fires at 0, 2, 4 (resolved at 1, 3, 5)
        engine.observe_train(step, {E: 0.5 if step % 2 == 0 else 1.5})
    fired = [a.step for a in engine.alerts if a.rule == "entropy_floor"]
    assert fired == [0, 2, 4] and ran == [0, 2, 4]
    assert engine.action_failures == 3 and sum("failed" in m for m in warned) == 1


def test_keyboard_interrupt_in_an_action_runs_the_others_first_then_propagates():
    ran: list[int] = []

    def interrupt(a: Alert) -> None:
        raise KeyboardInterrupt

    engine = AlertEngine(CollapseRules(entropy_floor=1.0), [interrupt, lambda a: ran.append(a.step)], warn=lambda m: None)
    with pytest.raises(KeyboardInterrupt):
        engine.observe_train(0, {E: 0.5})
    assert ran == [0] and [a.step for a in engine.alerts] == [0]


def test_delivery_failures_are_published_through_the_marker_sink():
    """``headwatch/alerts/action_failures`` is written when the count changes: a failing action at once, a failed
    webhook POST (counted later, in its thread) at the next logging step."""
    from headwatch.alerts.actions import SinkMarker

    class Sink:
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []

        def scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

        def text(self, tag: str, text: str, step: int) -> None:
            pass

    sink = Sink()
    sender = WebhookSender(f"http://127.0.0.1:{closed_port()}/x", timeout=0.5, retries=0)
    engine = AlertEngine(CollapseRules(entropy_floor=1.0), [SinkMarker(sink), sender], warn=lambda m: None)
    engine.observe_train(0, {E: 0.5})  # fires: the POST fails in the sender's thread
    sender.flush(timeout=5.0)
    engine.observe_train(1, {E: 0.5})  # still below: no new alert; the failure is published now
    failures = [(v, s) for t, v, s in sink.scalars if t == "headwatch/alerts/action_failures"]
    assert failures == [(1.0, 1)]
    engine.observe_train(2, {E: 0.5})
    assert [(v, s) for t, v, s in sink.scalars if t == "headwatch/alerts/action_failures"] == [(1.0, 1)]  # only on change
