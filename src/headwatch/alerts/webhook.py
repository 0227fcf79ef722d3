"""The webhook sender: a JSON POST of each alert from a background thread (no torch, no Lightning).

Guarantees: each attempt times out after at most 2 s; at most 5 retries; the training thread
never waits on the network (except :meth:`WebhookSender.flush`, bounded); only
``scheme://host[:port]`` of the URL is ever printed (paths, queries and tokens are secrets).
"""

from __future__ import annotations

import os
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from headwatch.errors import HeadwatchError, check_callable, check_int, check_optional, check_range
from headwatch.alerts.events import Alert

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


class WebhookSender:
    """POST each :class:`Alert` as JSON to ``url`` from one background thread.

    Args:
        url: http(s) URL (checked; never printed beyond ``scheme://host[:port]``).
        timeout: seconds per attempt, in (0, 2].
        retries: extra attempts after a failure, in [0, 5]; backoff 0.25 s, 0.5 s, then 1 s.
        on_failure: called from the sender thread with ``(what, error)`` after the last attempt
            failed; the error text holds the exception type and reason, never the URL.

    Raises:
        HeadwatchError: a bad URL (not echoed), timeout or retries out of range.
    """

    main_process_only = True

    def __init__(self, url: str, timeout: float = 2.0, retries: int = 2,
                 on_failure: Callable[[str, BaseException], None] | None = None) -> None:
        check_webhook_options(timeout, retries, ("timeout", "retries"))
        check_webhook_url(url)
        check_optional(check_callable, "on_failure", on_failure, "a callable (what, error) -> None")
        self._url = url
        self.timeout = float(timeout)
        self.retries = retries
        self.on_failure = on_failure
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    @property
    def redacted(self) -> str:
        return redact_url(self._url)

    def __call__(self, alert: Alert) -> None:
        """Queue ``alert``; returns at once."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headwatch-webhook")
        self._pending.append(self._executor.submit(self._post, alert))

    def _post(self, alert: Alert) -> None:
        body = alert.to_json().encode()
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self._url, data=body, method="POST", headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                    if 200 <= response.status < 300:
                        return
                    last = RuntimeError(f"HTTP {response.status}")
            except Exception as err:  # noqa: BLE001
                # the exception text may hold the URL: keep only its type and reason
                reason = getattr(err, "reason", None) or getattr(err, "code", None) or type(err).__name__
                last = RuntimeError(f"{type(err).__name__}: {reason}")
            if attempt < self.retries:
                time.sleep(min(0.25 * 2**attempt, 1.0))
        if self.on_failure is not None:
            self.on_failure(f"webhook POST to {self.redacted}", last or RuntimeError("unknown"))

    def flush(self, timeout: float | None = None, strict: bool = False) -> None:
        """Wait for posts still in flight, each at most ``timeout`` s (default: its timeouts and retries).

        An error raised by ``on_failure`` (a strict policy) is re-raised here when ``strict``.
        """
        limit = timeout if timeout is not None else (self.timeout + 1.0) * (self.retries + 1) + 1
        for future in self._pending:
            try:
                future.result(timeout=limit)
            except HeadwatchError:
                if strict:
                    raise
            except Exception:  # noqa: BLE001 - a post still running past the limit: recorded when it ends
                pass
        self._pending = [f for f in self._pending if not f.done()]

    def close(self) -> None:
        """Flush, then let the thread go (never blocks beyond :meth:`flush`)."""
        self.flush()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
