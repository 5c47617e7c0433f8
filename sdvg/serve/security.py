"""What is let in: the bind rule, the token (constant-time), session ids and video keys, the update rate."""
from __future__ import annotations

import hmac
import re
import time

DEFAULT_HOSTS = ("127.0.0.1", "::1", "localhost")  # the loopback default; any other bind needs a token
SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A run's video: its socket's session id, or `id.N` for a socket opened while another held the id (a name no client
# id can be, so no client's video is ever another's)
VIDEO_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}(\.[1-9][0-9]{0,5})?$")
MAX_SHARED_ID = 999_999  # sockets open at once under one session id


class BindError(ValueError):
    pass


def check_bind(host: str, token: str | None) -> None:
    """Binding anything but the loopback default needs a token (refused before anything listens)."""
    if host not in DEFAULT_HOSTS and not token:
        raise BindError(f"--host {host} exposes the server beyond this machine's loopback default; give "
                        "--token SECRET (clients send it as `Authorization: Bearer SECRET` or ?token=SECRET)")
    if token is not None and len(token) < 16:
        raise BindError("--token must be at least 16 characters (e.g. `python -c 'import secrets; "
                        "print(secrets.token_urlsafe(24))'`)")


def token_matches(given: str | None, token: str) -> bool:
    """Constant-time comparison (hmac.compare_digest) of what a client sent with the server's token."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode("utf-8"))


def token_of(headers: dict[str, str], query: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return query.get("token")


def valid_session_id(session_id: str) -> bool:
    return bool(SESSION_ID.match(session_id))


def valid_video_key(key: str) -> bool:
    return bool(VIDEO_KEY.match(key))


class RateLimit:
    """A token bucket: `rate` updates per second sustained, `burst` at once."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.last = float(burst), clock()
        self.refused = 0

    def allow(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.refused += 1
        return False
