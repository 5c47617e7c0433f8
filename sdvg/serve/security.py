"""What is let in: the bind rule, the token (where it comes from, constant-time compare, its cookie, kept out of
logs), CORS origins, session ids and video keys, the update rate."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import time
from urllib.parse import urlsplit

DEFAULT_HOSTS = ("127.0.0.1", "::1", "localhost")  # the loopback default; any other bind needs a token
SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A run's video: its socket's session id, or `id.N` for a socket opened while another held the id (a name no client
# id can be, so no client's video is ever another's)
VIDEO_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}(\.[1-9][0-9]{0,5})?(~[0-9a-f]{16})?$")  # ~hex: one run's own video
MAX_SHARED_ID = 999_999  # sockets open at once under one session id


class BindError(ValueError):
    pass


def check_bind(host: str, token: str | None) -> None:
    """Binding anything but the loopback default needs a token (refused before anything listens)."""
    if host not in DEFAULT_HOSTS and not token:
        raise BindError(f"--host {host} exposes the server beyond this machine's loopback default; give a token: "
                        f"--token-file FILE or the {TOKEN_ENV} environment variable (--token SECRET works too, but "
                        "`ps` shows it); clients send it as `Authorization: Bearer SECRET` or ?token=SECRET, a browser "
                        "once as http://HOST:PORT/?token=SECRET (a cookie keeps it)")
    if token is not None and len(token) < 16:
        raise BindError("--token must be at least 16 characters (e.g. `python -c 'import secrets; "
                        "print(secrets.token_urlsafe(24))'`)")


TOKEN_ENV = "SDVG_SERVE_TOKEN"  # the token from the environment (argv is visible to `ps`)
MAX_TOKEN_FILE_BYTES = 4096
COOKIE_NAME = "sdvg_token"
TOKEN_IN_TEXT = re.compile(r"(token=)[^&\s\"']*", re.IGNORECASE)


def resolve_token(given: str | None, token_file: str | None, environ) -> str | None:
    """The server's token: --token (visible to `ps`), else --token-file (its first line; at most 4 KiB), else the
    SDVG_SERVE_TOKEN environment variable, else None; BindError naming the problem and the fix."""
    sources = [name for name, value in (("--token", given), ("--token-file", token_file)) if value is not None]
    if len(sources) > 1:
        raise BindError("give the token one way: --token-file FILE (or the SDVG_SERVE_TOKEN variable), not --token too")
    if token_file is not None:
        try:
            with open(token_file, "rb") as f:
                raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
        except OSError as exc:
            raise BindError(f"--token-file {token_file}: cannot be read ({exc.strerror or exc})") from None
        if len(raw) > MAX_TOKEN_FILE_BYTES:
            raise BindError(f"--token-file {token_file}: more than {MAX_TOKEN_FILE_BYTES} bytes; put the token alone "
                            "in the file")
        try:
            lines = raw.decode("utf-8").strip().splitlines()
        except UnicodeDecodeError:
            raise BindError(f"--token-file {token_file}: not UTF-8 text; put the token alone in the file") from None
        if not lines or not lines[0].strip():
            raise BindError(f"--token-file {token_file}: empty; put the token in it (e.g. `python -c 'import secrets; "
                            "print(secrets.token_urlsafe(24))' > FILE`)")
        return lines[0].strip()
    if given is not None:
        return given
    value = environ.get(TOKEN_ENV)
    return value.strip() if value and value.strip() else None


def cookie_value(token: str) -> str:
    """What the browser's cookie holds once it showed the token (`GET /?token=T`): a value derived from the token
    (HMAC-SHA256), not the token itself."""
    return hmac.new(token.encode("utf-8"), b"sdvg serve cookie", hashlib.sha256).hexdigest()


def redact_tokens(text: str) -> str:
    """`text` with every `token=...` value replaced (log lines name request paths, queries included)."""
    return TOKEN_IN_TEXT.sub(r"\1<redacted>", text)


def check_origin(origin: str) -> str:
    """A --cors-origin: scheme://host[:port], nothing else (no path, no wildcard); BindError otherwise."""
    if not re.fullmatch(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?", origin):
        raise BindError(f"--cors-origin {origin!r}: give an origin as the browser sends it, scheme://host[:port] "
                        "(e.g. https://studio.example.com), one per flag; '*' is not taken (the token would be offered "
                        "to every site)")
    return origin


LOOPBACK_NAMES = ("localhost",)
HOST_NAME = re.compile(r"^\.?[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*$")


def check_allowed_host(name: str) -> str:
    """An --allowed-host: a host name (www.example.com), a leading-dot suffix (.example.com: it and every name under
    it), an IP address, or `*` (no Host check: only behind a proxy that checks it); BindError otherwise."""
    if name == "*" or _ip(name) is not None or (len(name) <= 253 and HOST_NAME.match(name)):
        return name.lower()
    raise BindError(f"--allowed-host {name!r}: give a host name as clients type it (studio.example.com), .example.com "
                    "for a domain and its subdomains, an IP address, or '*' behind a proxy that checks Host itself")


def _ip(text: str):
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def host_of(header: str) -> str | None:
    """The host part of a Host header (`name[:port]`, `[v6][:port]`), lower-cased; None when it is malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        if end < 0 or (header[end + 1:] and not re.fullmatch(r":[0-9]{1,5}", header[end + 1:])):
            return None
        return header[1:end] if _ip(header[1:end]) is not None else None
    name, _, port = header.partition(":")
    if port and not port.isdigit():
        return None
    if _ip(name) is None and not HOST_NAME.match(name):
        return None
    return name


def host_allowed(header: str | None, bind: str, allowed: tuple[str, ...] = ()) -> bool:
    """The Host rule against DNS rebinding: a request's Host names the bind address, a loopback name or address for
    a loopback bind, any IP address for a wildcard bind (0.0.0.0, ::), or one of `allowed` (--allowed-host; `*` lets
    every Host in). A request without one (HTTP/1.0, no browser) passes."""
    if header is None or "*" in allowed:
        return True
    host = host_of(header)
    if host is None:
        return False
    for name in (a.lower() for a in allowed):
        if host == name or (name.startswith(".") and (host == name[1:] or host.endswith(name))):
            return True
    addr, bound = _ip(host), _ip(bind)
    if host == bind.lower().strip("[]") or (addr is not None and bound is not None and addr == bound):
        return True
    if bind in LOOPBACK_NAMES or (bound is not None and bound.is_loopback):  # a loopback bind
        return host in LOOPBACK_NAMES or (addr is not None and addr.is_loopback)
    if bound is not None and bound.is_unspecified:  # every interface: reached by address, or by a name allowed
        return addr is not None or host in LOOPBACK_NAMES
    return False


def origin_allowed(origin: str | None, host: str | None, scheme: str, cors_origins: tuple[str, ...] = ()) -> bool:
    """The Origin rule (OWASP's for websockets): a request that names an origin (every browser request that could
    change state or read data does) must come from the server's own origin (scheme://Host) or a --cors-origin;
    one without an Origin header (not a browser page) passes."""
    if origin is None:
        return True
    if origin in cors_origins:
        return True
    parts = urlsplit(origin)
    secure = scheme in ("https", "wss")
    return host is not None and parts.netloc.lower() == host.strip().lower() \
        and parts.scheme == ("https" if secure else "http") and not parts.path


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
