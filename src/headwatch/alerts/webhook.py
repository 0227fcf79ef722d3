"""The webhook sender: a JSON POST of each alert from a background thread (no torch, no Lightning).

Time bounds (documented in ``docs/faults.md``, tested against local servers that refuse, hang and trickle):

- each attempt ends after at most ``timeout`` (<= 2 s) in total, connection and response included: a
  server that answers one byte at a time is cut off (its socket is shut down at the deadline);
- at most ``retries`` (<= 5) more attempts, with backoff 0.25 s, 0.5 s, then 1 s: one alert takes at most
  ``(retries + 1) * timeout + backoff`` (6.75 s with the defaults, 16.75 s at the largest settings);
- the training thread never waits on the network, except in :meth:`WebhookSender.flush` and
  :meth:`WebhookSender.close`, which wait at most ``timeout`` seconds in all (default :data:`CLOSE_TIMEOUT`,
  2 s); at close, the alerts not delivered by then (queued, or still in flight) are abandoned, counted as
  failures and handed, all at once, to ``on_undelivered`` (the alert engine marks them ``"undelivered"`` in
  ``headwatch_alerts.jsonl`` and warns once);
- the sender's thread is a daemon: it never holds the interpreter's exit.

Redirects: a 301, 302 or 303 answer is a failure naming the redacted ``Location`` (following it would turn the
POST into an empty GET, which 0.3 counted as sent); a 307 or 308 is followed, the POST and its body kept, to the
same scheme, host and port only (at most :data:`MAX_REDIRECTS` times); one to another host is a failure naming
it. Neither is retried. ``https://user:password@host/...`` sends HTTP basic authentication: the credentials are
taken out of the URL before it is opened (never part of a host name looked up) and never printed.

Every failed delivery (after its retries, or abandoned) is counted in ``failures`` and reported to
``on_failure``; the alert engine wires that to its own failure count and warn-once policy when it is
not set. Only ``scheme://host[:port]`` of the URL is ever printed (paths, queries and tokens are secrets).
"""

from __future__ import annotations

import base64
import http.client
import os
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from headwatch.errors import HeadwatchError, check_callable, check_int, check_optional, check_range
from headwatch.alerts.events import Alert

CLOSE_TIMEOUT = 2.0
"""Longest wait, in seconds, of :meth:`WebhookSender.flush` and :meth:`WebhookSender.close` by default."""

MAX_REDIRECTS = 3
"""307/308 answers followed for one attempt (to the same host only)."""

WEBHOOK_ENV = "HEADWATCH_WEBHOOK_URL"
"""Environment variable read for the webhook URL when ``webhook_url`` is not given."""


def redact_url(url: str) -> str:
    """``scheme://host[:port]`` only: paths, query strings and tokens of webhook URLs are secrets. Never raises."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}/..."
    except ValueError:
        return "<an unparsable URL>"


def split_credentials(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without its ``user:password@`` part, and the headers that carry it (HTTP basic authentication,
    RFC 7617: ``Authorization: Basic base64(user:password)``, both percent-decoded); no headers without one."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, {}
    user = urllib.parse.unquote(parts.username or "")
    password = urllib.parse.unquote(parts.password or "")
    host = parts.netloc.rpartition("@")[2]
    token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    return urllib.parse.urlunsplit(parts._replace(netloc=host)), {"Authorization": f"Basic {token}"}


def _same_origin(a: str, b: str) -> bool:
    pa, pb = urllib.parse.urlsplit(a), urllib.parse.urlsplit(b)
    default = {"http": 80, "https": 443}
    return (pa.scheme, pa.hostname, pa.port or default.get(pa.scheme)) == (pb.scheme, pb.hostname, pb.port or default.get(pb.scheme))


class _Refused(Exception):
    """A final answer no retry changes (a redirect not followed); its text names the redacted target."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects surface as ``HTTPError`` (urllib would turn a POST into an empty GET, to any host)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def check_webhook_url(url: str) -> None:
    """http(s) with a host and a numeric port, or HeadwatchError that does not echo the URL (a secret)."""
    if not isinstance(url, str):
        raise HeadwatchError(f"the webhook URL must be a str, got a {type(url).__name__} (not shown: URLs hold secrets)")
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # raises on a non-numeric port (a token in the wrong place)
    except ValueError:
        raise HeadwatchError("the webhook URL cannot be parsed (bad port or brackets); it is not shown here") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HeadwatchError(f"the webhook URL must be http(s)://host/..., got {redact_url(url)}")


def resolve_webhook_url(webhook_url: str | None) -> str | None:
    """``webhook_url``, else ``$HEADWATCH_WEBHOOK_URL``, else None; checked (HeadwatchError without echo)."""
    url = webhook_url if webhook_url is not None else os.environ.get(WEBHOOK_ENV) or None
    if url is not None:
        check_webhook_url(url)
    return url


def check_webhook_options(
    timeout: float, retries: int, names: tuple[str, str] = ("webhook_timeout", "webhook_retries")
) -> None:
    """``timeout`` in (0, 2] seconds and ``retries`` an int in [0, 5], or HeadwatchError; ``names``: the
    arguments as the caller calls them (the Lightning alert's by default, :class:`WebhookSender`'s own)."""
    check_range(names[0], timeout, 0, 2, low_open=True)
    check_int(names[1], retries, minimum=0, maximum=5)


class _Deadline:
    """Shuts an attempt's socket down when its time is up, so a server that trickles cannot hold it."""

    def __init__(self, seconds: float) -> None:
        self.sock: Any = None
        self.expired = False
        self._timer = threading.Timer(seconds, self.expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()

    def expire(self) -> None:
        self.expired = True
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Cut:
    """A connection whose socket the attempt's :class:`_Deadline` can shut down (mixed into http.client's)."""

    deadline: _Deadline

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.deadline.sock = self.sock  # type: ignore[attr-defined]
        if self.deadline.expired:
            self.deadline.expire()


class _HTTPConnection(_Cut, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_Cut, http.client.HTTPSConnection):
    pass


def _connection(cls: type, deadline: _Deadline) -> Callable[..., Any]:
    def make(*args: Any, **kwargs: Any) -> Any:
        conn = cls(*args, **kwargs)
        conn.deadline = deadline
        return conn

    return make


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    """urllib's opener (proxies from the environment, redirects) with connections the deadline can cut."""

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req: Any) -> Any:
            return self.do_open(_connection(_HTTPConnection, deadline), req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req: Any) -> Any:
            return self.do_open(_connection(_HTTPSConnection, deadline), req, context=self._context)

    return urllib.request.build_opener(HTTP, HTTPS, _NoRedirect)


class WebhookSender:
    """POST each :class:`Alert` as JSON to ``url`` from one background (daemon) thread; time bounds, redirects and
    basic authentication in the module docstring.

    Args:
        url: http(s) URL (checked; never printed beyond ``scheme://host[:port]``); ``user:password@host`` sends
            HTTP basic authentication.
        timeout: seconds per attempt in total, in (0, 2].
        retries: extra attempts after a failure, in [0, 5]; backoff 0.25 s, 0.5 s, then 1 s.
        on_failure: called with ``(what, error)`` after the last attempt failed; the error text holds the
            exception type and reason (a redirect: the redacted ``Location``), never the URL. The alert engine sets
            it to its failure policy when it is None.
        on_undelivered: called once at :meth:`close` with the alerts abandoned then (not delivered within its
            timeout) and that timeout in seconds; the alert engine sets it when it is None (a record per alert in
            its JSON Lines log, one warning). Without it, each abandoned alert goes to ``on_failure``.

    Attributes:
        sent, failures: deliveries that succeeded, and that failed or were abandoned.
        undelivered: the alerts abandoned at :meth:`close`.

    Raises:
        HeadwatchError: a bad URL (not echoed), timeout or retries out of range, a callback that is not callable.
    """

    main_process_only = True

    def __init__(self, url: str, timeout: float = 2.0, retries: int = 2,
                 on_failure: Callable[[str, BaseException], None] | None = None,
                 on_undelivered: Callable[[list[Alert], float], None] | None = None) -> None:  # fmt: skip
        check_webhook_options(timeout, retries, ("timeout", "retries"))
        check_webhook_url(url)
        check_optional(check_callable, "on_failure", on_failure, "a callable (what, error) -> None")
        check_optional(check_callable, "on_undelivered", on_undelivered, "a callable (alerts, seconds) -> None")
        self._url, self._headers = split_credentials(url)
        self._redacted = redact_url(url)
        self.timeout = float(timeout)
        self.retries = retries
        self.on_failure = on_failure
        self.on_undelivered = on_undelivered
        self.sent = 0
        self.failures = 0
        self.undelivered: list[Alert] = []
        self._queue: queue.Queue[Alert | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self._unfinished = 0
        self._current: Alert | None = None  # the alert being posted
        self._abandoned: set[int] = set()  # id() of alerts given up at close, whose post may still be in flight
        self._errors: list[BaseException] = []  # raised by on_failure (a strict policy): re-raised at flush

    @property
    def redacted(self) -> str:
        return self._redacted

    @property
    def per_alert_seconds(self) -> float:
        """The longest one alert can take: every attempt's timeout plus the backoff between them."""
        return (self.retries + 1) * self.timeout + sum(min(0.25 * 2**a, 1.0) for a in range(self.retries))

    def __call__(self, alert: Alert) -> None:
        """Queue ``alert``; returns at once."""
        with self._lock:
            self._unfinished += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="headwatch-webhook", daemon=True)
                self._thread.start()
        self._queue.put(alert)

    def _work(self) -> None:
        while True:
            alert = self._queue.get()
            if alert is None:
                return
            with self._lock:
                self._current = alert
            try:
                self._post(alert)
            finally:
                with self._lock:
                    self._current = None
                    if id(alert) in self._abandoned:
                        self._abandoned.discard(id(alert))  # already counted at close
                    else:
                        self._unfinished -= 1
                    self._lock.notify_all()

    def _attempt(self, body: bytes) -> None:
        """One POST within ``timeout`` in all, following 307/308 to the same host; raises on any failure
        (:class:`_Refused`: final, not retried)."""
        url = self._url
        with _Deadline(self.timeout) as deadline:
            for _ in range(MAX_REDIRECTS + 1):
                headers = {"Content-Type": "application/json", **self._headers}
                request = urllib.request.Request(url, data=body, method="POST", headers=headers)
                try:
                    with _opener(deadline).open(request, timeout=self.timeout) as response:
                        if 200 <= response.status < 300:
                            return
                        raise RuntimeError(f"HTTP {response.status}")
                except urllib.error.HTTPError as err:
                    if err.code not in (301, 302, 303, 307, 308):
                        raise
                    given = err.headers.get("Location") or ""
                    location = split_credentials(urllib.parse.urljoin(url, given))[0]  # never a password in a host name
                    shown = redact_url(location) if given else "no Location"
                    if err.code in (301, 302, 303):
                        raise _Refused(f"HTTP {err.code} redirect to {shown} not followed: it would turn the POST "
                                       "into an empty GET; set the webhook URL to the final address") from None
                    if not given or not _same_origin(location, url):
                        raise _Refused(f"HTTP {err.code} redirect to {shown}, another host than "
                                       f"{self.redacted}, not followed; set the webhook URL to the final address") from None
                    url = location
                except Exception as err:
                    # the socket's own timeout (the same seconds) may fire before the deadline's timer thread runs
                    if deadline.expired or isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError):
                        raise RuntimeError(f"no complete answer within {self.timeout:g} s") from None
                    raise
        raise _Refused(f"more than {MAX_REDIRECTS} redirects (307/308); set the webhook URL to the final address")

    def _post(self, alert: Alert) -> None:
        body = alert.to_json().encode()
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            try:
                self._attempt(body)
            except (_Refused, RuntimeError) as err:
                last = RuntimeError(str(err))
                if isinstance(err, _Refused):
                    break
            except Exception as err:  # noqa: BLE001
                # the exception text may hold the URL: keep only its type and reason
                reason = getattr(err, "reason", None) or getattr(err, "code", None) or type(err).__name__
                last = RuntimeError(f"{type(err).__name__}: {reason}")
            else:
                with self._lock:
                    if id(alert) not in self._abandoned:
                        self.sent += 1
                return
            if attempt < self.retries:
                time.sleep(min(0.25 * 2**attempt, 1.0))
        with self._lock:
            abandoned = id(alert) in self._abandoned
        if not abandoned:
            self._failed(f"webhook POST to {self.redacted}", last or RuntimeError("unknown"))

    def _failed(self, what: str, err: BaseException) -> None:
        self.failures += 1
        if self.on_failure is not None:
            try:
                self.on_failure(what, err)
            except Exception as raised:  # noqa: BLE001 - a strict policy: raised at flush
                self._errors.append(raised)

    def flush(self, timeout: float | None = None, strict: bool = False) -> bool:
        """Wait until every queued alert is delivered or has failed, at most ``timeout`` seconds in all
        (default :data:`CLOSE_TIMEOUT`). Returns whether everything finished.

        An error raised by ``on_failure`` (a strict policy) is re-raised here when ``strict``.
        """
        limit = CLOSE_TIMEOUT if timeout is None else timeout
        end = time.monotonic() + limit
        with self._lock:
            while self._unfinished and (left := end - time.monotonic()) > 0:
                self._lock.wait(left)
            done = not self._unfinished
        errors, self._errors = self._errors, []
        if strict and errors:
            raise errors[0]
        return done

    def close(self, timeout: float | None = None) -> list[Alert]:
        """Flush (at most ``timeout`` s, default :data:`CLOSE_TIMEOUT`), then let the thread go; returns the alerts
        abandoned. Those (still queued, or in flight: that post ends by its own deadline, in the background, and
        is then neither counted sent nor failed again) are counted as failures and handed to ``on_undelivered``
        (else each to ``on_failure``)."""
        limit = CLOSE_TIMEOUT if timeout is None else timeout
        self.flush(limit)
        abandoned: list[Alert] = []
        with self._lock:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    abandoned.append(item)
            if self._current is not None and id(self._current) not in self._abandoned:
                self._abandoned.add(id(self._current))
                abandoned.insert(0, self._current)
            self._unfinished = 0
        self.undelivered += abandoned
        if abandoned and self.on_undelivered is not None:
            self.failures += len(abandoned)
            try:
                self.on_undelivered(abandoned, limit)
            except Exception as raised:  # noqa: BLE001 - a strict policy
                self._errors.append(raised)
        else:
            for _ in abandoned:
                self._failed(f"webhook POST to {self.redacted}", RuntimeError(f"abandoned at close after {limit:g} s"))
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None
        return abandoned
