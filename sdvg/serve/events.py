"""One log line per session event (logger `sdvg.serve.sessions`, INFO: `sdvg serve --log-level info` shows them):
started / queued / busy / reset / completed / failed / ended / closed / shutdown, and the first refusal of each
reason on a socket (the rest are counted in `sdvg_serve_refused_messages_total`). Each line is
`session <video key> <event> key=value ...`, the client's address and kind (plain or sdvg) included, never a
prompt's text (its length only) nor a token."""
from __future__ import annotations

import logging

LOG = logging.getLogger("sdvg.serve.sessions")


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    text = str(v)
    return text if text and " " not in text and len(text) <= 80 else repr(text[:80])


def session_event(session, event: str, **fields) -> None:
    """Log `event` of `session` (a serve Session) with `fields` as key=value pairs."""
    if not LOG.isEnabledFor(logging.INFO):
        return
    head = {"client": getattr(session, "client", None) or "?", "kind": "sdvg" if session.superset else "plain"}
    pairs = " ".join(f"{k}={_value(v)}" for k, v in {**head, **fields}.items() if v is not None)
    LOG.info("session %s %s %s", session.video_key, event, pairs)


def refusal_event(session, reason: str, message: str) -> None:
    """The first refusal of `reason` on this socket (later ones are only counted)."""
    seen = session.__dict__.setdefault("_refusals_logged", set())
    if reason in seen:
        return
    seen.add(reason)
    session_event(session, "refused", reason=reason, why=message[:80])
