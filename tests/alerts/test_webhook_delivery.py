"""What the webhook counts as delivered, against a local ``http.server`` (no network).

A 301/302/303 answer is a failure naming the redacted ``Location`` (0.3 followed it, turned the POST into an
empty GET, to any host, and counted it sent); a 307/308 is followed with the POST and its body to the same host
only; ``user:password@host`` sends basic authentication and the password shows in no log record and no host
name looked up; ``close()`` returns within 2 s and marks what it gave up in ``headwatch_alerts.jsonl``.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from headwatch.alerts import (
    Alert,
    AlertEngine,
    CollapseRules,
    WebhookSender,
    standard_actions,
)
from headwatch.report import read_alerts_jsonl

E = "headwatch/logits/entropy"


def alert(step: int = 0) -> Alert:
    return Alert(time="t", step=step, epoch=0, rule="entropy_floor", metrics={}, message="m")


class Hook:
    """A local HTTP server: ``answers[path] = (code, headers)`` (default 200); ``hang`` holds every POST until
    :meth:`close`. Every request is recorded as ``(method, path, headers, body)``."""

    def __init__(self, answers: dict | None = None, hang: bool = False) -> None:
        self.answers, self.hang, self.requests = answers or {}, hang, []
        self.release = threading.Event()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def handle_any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hook.requests.append((self.command, self.path, dict(self.headers), body))
                if hook.hang:
                    hook.release.wait(30)
                code, headers = hook.answers.get(self.path, (200, {}))
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v.replace("PORT", str(hook.port)))
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET = handle_any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str = "/hooks/SECRET", auth: str = "") -> str:
        return f"http://{auth}127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook_factory():
    made: list[Hook] = []

    def make(*args, **kwargs) -> Hook:
        made.append(Hook(*args, **kwargs))
        return made[-1]

    yield make
    for hook in made:
        hook.close()


def deliver(url: str, retries: int = 2) -> tuple[WebhookSender, list[str]]:
    failures: list[str] = []
    sender = WebhookSender(url, timeout=1.0, retries=retries, on_failure=lambda what, err: failures.append(f"{what}: {err}"))
    sender(alert())
    assert sender.flush(timeout=10.0)
    return sender, failures


@pytest.mark.parametrize("code", [301, 302, 303])
def test_a_redirect_that_would_turn_the_post_into_a_get_is_a_failure_naming_the_redacted_location(hook_factory, code):
    hook = hook_factory({"/hooks/SECRET": (code, {"Location": "http://127.0.0.1:PORT/moved/TOKEN?key=K"})})
    sender, failures = deliver(hook.url())
    assert sender.sent == 0 and sender.failures == 1 and len(failures) == 1
    assert f"HTTP {code} redirect to http://127.0.0.1:{hook.port}/..." in failures[0], failures
    assert "TOKEN" not in failures[0] and "SECRET" not in failures[0] and "K" not in failures[0].split("/...")[-1]
    assert [(m, p) for m, p, _, _ in hook.requests] == [("POST", "/hooks/SECRET")]  # not followed, not retried


@pytest.mark.parametrize("code", [307, 308])
def test_a_307_or_308_to_the_same_host_is_followed_with_the_post_and_its_body(hook_factory, code):
    hook = hook_factory({"/hooks/SECRET": (code, {"Location": "/final/SECRET2"})})
    sender, failures = deliver(hook.url())
    assert sender.sent == 1 and sender.failures == 0 and not failures
    (m1, p1, _, b1), (m2, p2, _, b2) = hook.requests
    assert (m1, p1, m2, p2) == ("POST", "/hooks/SECRET", "POST", "/final/SECRET2")
    assert b1 == b2 == alert().to_json().encode()


@pytest.mark.parametrize("code", [307, 308])
def test_a_307_or_308_to_another_host_is_refused(hook_factory, code):
    hook = hook_factory({"/hooks/SECRET": (code, {"Location": "http://localhost:PORT/final/SECRET2"})})
    sender, failures = deliver(hook.url())
    assert sender.sent == 0 and sender.failures == 1
    assert f"redirect to http://localhost:{hook.port}/..., another host" in failures[0], failures
    assert "SECRET2" not in failures[0] and len(hook.requests) == 1


def test_close_returns_within_two_seconds_and_marks_the_alert_undelivered(hook_factory, tmp_path):
    hook = hook_factory(hang=True)
    path = tmp_path / "headwatch_alerts.jsonl"
    warned: list[str] = []
    sender = WebhookSender(hook.url(), timeout=2.0, retries=5)
    engine = AlertEngine(CollapseRules(entropy_floor=1.0), standard_actions(jsonl_path=path, webhook=sender, warn=lambda m: None),
                         warn=warned.append)  # fmt: skip
    engine.observe_train(7, {E: 0.5})
    start = time.monotonic()
    engine.close()
    took = time.monotonic() - start
    assert took < 2.0 + 0.5, f"close took {took:.2f} s"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r.get("undelivered")) for r in lines] == [(7, None), (7, f"webhook http://127.0.0.1:{hook.port}/...")]
    said = [m for m in warned if "not delivered" in m]
    assert len(warned) == 1 and len(said) == 1 and "steps 7" in said[0] and str(path) in said[0], warned
    assert "SECRET" not in said[0]
    assert engine.action_failures == 1 and sender.sent == 0
    assert [r["step"] for r in read_alerts_jsonl(path)] == [7]  # the report counts the alert once
    hook.release.set()
    time.sleep(0.5)  # the post in flight ends: it was given up, so it is not counted again
    assert sender.failures == 1 and engine.action_failures == 1


def test_close_timeout_is_configurable(hook_factory, tmp_path):
    hook = hook_factory(hang=True)
    sender = WebhookSender(hook.url(), timeout=2.0, retries=0)
    engine = AlertEngine(CollapseRules(entropy_floor=1.0), [sender], warn=lambda m: None)
    engine.observe_train(0, {E: 0.5})
    start = time.monotonic()
    engine.close(timeout=0.3)
    assert time.monotonic() - start < 0.3 + 0.4
    assert [a.step for a in sender.undelivered] == [0]


def test_basic_auth_from_the_url_and_the_password_in_no_log_and_no_host_name(hook_factory, caplog, monkeypatch):
    hook = hook_factory({"/fail": (500, {})})
    looked_up: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        looked_up.append(str(host))
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    log = logging.getLogger("headwatch.test.webhook")
    with caplog.at_level(logging.DEBUG):
        engine = AlertEngine(CollapseRules(entropy_floor=1.0), [], warn=log.warning, info=log.info)
        ok = WebhookSender(hook.url("/ok", auth="alice:pa%40ss%3Aword@"), timeout=1.0, retries=0)
        failing = WebhookSender(hook.url("/fail", auth="alice:pa%40ss%3Aword@"), timeout=1.0, retries=0)
        engine.actions += [ok, failing]
        engine.observe_train(0, {E: 0.5})
        assert ok.flush(5.0) and failing.flush(5.0)
        engine.close()
    token = base64.b64encode(b"alice:pa@ss:word").decode()
    assert [h.get("Authorization") for _, _, h, _ in hook.requests] == [f"Basic {token}"] * 2
    assert ok.sent == 1 and failing.failures == 1 and engine.action_failures == 1
    records = [r.getMessage() for r in caplog.records]
    assert any("webhook POST to http://127.0.0.1" in m and "Internal Server Error" in m for m in records), records
    for secret in ("pa@ss", "pa%40ss", "word", token):
        assert not any(secret in m for m in records), (secret, records)
        assert not any(secret in h for h in looked_up), looked_up
    assert "127.0.0.1" in looked_up


def test_a_redirect_loop_ends_after_three_hops_and_is_not_retried(hook_factory):
    hook = hook_factory({"/hooks/SECRET": (307, {"Location": "/hooks/SECRET"})})
    sender, failures = deliver(hook.url())
    assert sender.sent == 0 and sender.failures == 1 and "more than 3 redirects" in failures[0], failures
    assert len(hook.requests) == 4  # the first POST and three followed; the retries not spent on it
