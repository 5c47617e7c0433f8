"""Who gets in (ASGI middleware). `SiteGate`, outermost: every request but `GET /health` must name an allowed `Host`
(the bind address, a loopback name for a loopback bind, an --allowed-host: DNS rebinding cannot reach the server
under another name) and, where it carries an `Origin` (browsers send one), come from the server's own origin or a
--cors-origin (a page elsewhere cannot drive it, token or not). Refused: HTTP 400 (Host) or 403 (Origin) naming the
flag; a websocket closed with 1008 before it is accepted (the client sees 403).

`TokenGate`: with a token, every HTTP request and websocket but
`GET /health` must show it, as `Authorization: Bearer T`, `?token=T`, or the cookie a browser got by
opening `GET /?token=T` once (HttpOnly, SameSite=Strict, a value derived from the token; that request is
redirected to `/`, so the token leaves the address bar). A cookie alone is taken only from the server's
own origin or a `--cors-origin` (a page elsewhere cannot ride on it). Refused: HTTP 401; a websocket
closed with 1008 before it is accepted (the client sees 403). `TokenRedaction` keeps the token out of
uvicorn's access and error logs."""
from __future__ import annotations

import logging
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, urlsplit

from starlette.responses import PlainTextResponse, Response

from sdvg.serve.security import (COOKIE_NAME, cookie_value, host_allowed, origin_allowed, redact_tokens, token_matches,
                                 token_of)

OPEN_PATHS = ("/health",)  # answered without the token (says "OK" and nothing else)
UVICORN_LOGGERS = ("uvicorn.access", "uvicorn.error")


class TokenRedaction(logging.Filter):
    """Every record of the logger it filters has `token=...` values replaced (uvicorn logs request paths with their
    queries: `GET /?token=...`, `"WebSocket /session/x?token=..." [accepted]`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact_tokens(record.msg)
        if isinstance(record.args, tuple):  # the arguments stay arguments (uvicorn's access formatter reads them)
            record.args = tuple(redact_tokens(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact_tokens(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


def redact_uvicorn_logs() -> None:
    """Install `TokenRedaction` on uvicorn's loggers (once; after uvicorn configured its logging)."""
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TokenRedaction) for f in logger.filters):
            logger.addFilter(TokenRedaction())


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def _refuse(scope, receive, send, status: int, why: str) -> None:
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008, "reason": why[:120]})
        return
    await PlainTextResponse(why, status_code=status)(scope, receive, send)


class SiteGate:
    """The Host and Origin rules (security.host_allowed, security.origin_allowed) before anything else runs; `bind`:
    the address served, `allowed_hosts`: --allowed-host, `origins`: --cors-origin; `refused(reason)` counts each
    refusal ('host' or 'origin')."""

    def __init__(self, app, bind: str, allowed_hosts: tuple[str, ...] = (), origins: tuple[str, ...] = (),
                 refused=None):
        self.app, self.bind, self.allowed_hosts, self.origins = app, bind, tuple(allowed_hosts), tuple(origins)
        self.refused = refused or (lambda reason: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        host = headers.get("host")
        if not host_allowed(host, self.bind, self.allowed_hosts):
            self.refused("host")
            return await _refuse(scope, receive, send, 400,
                                 f"Host {host[:80]!r} is not a name of this server; reach it by its address, or start "
                                 "it with --allowed-host NAME for the name your clients use")
        if not origin_allowed(headers.get("origin"), host, scope.get("scheme", "http"), self.origins):
            self.refused("origin")
            return await _refuse(scope, receive, send, 403,
                                 f"Origin {headers.get('origin', '')[:80]!r} may not use this server; serve the page "
                                 "from it (--static-dir) or start it with --cors-origin ORIGIN")
        return await self.app(scope, receive, send)


class TokenGate:
    """`token` None: everything passes. `origins`: the --cors-origin values (a cookie is also taken from them)."""

    def __init__(self, app, token: str | None, origins: tuple[str, ...] = ()):
        self.app, self.token, self.origins = app, token, tuple(origins)
        self.cookie = None if token is None else cookie_value(token)

    def _same_site(self, headers: dict, scheme: str) -> bool:
        """The request comes from the server's own origin or an allowed one (or names none: not a browser page)."""
        origin = headers.get("origin")
        if origin is None or origin in self.origins:
            return True
        parts = urlsplit(origin)
        return parts.netloc == headers.get("host") and parts.scheme in (scheme, scheme.replace("ws", "http"))

    async def __call__(self, scope, receive, send):
        if self.token is None or scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        query = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        if token_matches(token_of(headers, query), self.token):
            if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == "/" and "token" in query:
                return await self._set_cookie(scope, receive, send)
            return await self.app(scope, receive, send)
        jar = SimpleCookie()
        try:
            jar.load(headers.get("cookie", ""))
        except Exception:  # noqa: BLE001 (a malformed cookie header is no cookie)
            jar = SimpleCookie()
        shown = jar[COOKIE_NAME].value if COOKIE_NAME in jar else None
        if token_matches(shown, self.cookie) and self._same_site(headers, scope.get("scheme", "http")):
            return await self.app(scope, receive, send)
        await _refuse(scope, receive, send, 401, "missing or wrong token")

    async def _set_cookie(self, scope, receive, send):
        """`GET /?token=T`: the cookie, and a redirect to `/` (the token leaves the address bar and the history)."""
        response = Response(status_code=303, headers={"Location": "/", "Cache-Control": "no-store",
                                                      "Referrer-Policy": "no-referrer"})
        response.set_cookie(COOKIE_NAME, self.cookie, httponly=True, samesite="strict", path="/",
                            secure=scope.get("scheme") == "https")
        await response(scope, receive, send)
