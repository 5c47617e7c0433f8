"""A client that stops reading (docs/server.md, "Slow clients"): its frames are bounded, then its socket is cut and
counted, its session leaves the worker's rotation, and the other sessions go on. A real uvicorn server on
127.0.0.1 and the `websockets` library as both clients; the one that stops reading has a small receive buffer and
a one-message queue, so that the library itself stops reading the socket (as a frozen browser tab's would), and
the server's kernel send buffer of its connection is shrunk as a congested path would leave it (on loopback it
grows to megabytes first: the same stall, only later)."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
msgpack = pytest.importorskip("msgpack")
websockets = pytest.importorskip("websockets")

from serve_harness import recv_json, run_session, running_server  # noqa: E402

STALL_S = 1.0
BOUND_S = 60.0  # how long the cut may take on a loaded 2-core machine (it takes about STALL_S)


def stalled_socket(url: str) -> socket.socket:
    """A connected TCP socket whose receive buffer is as small as the kernel allows."""
    host, port = url.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    return sock


async def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {BOUND_S:g} s"
        await asyncio.sleep(0.05)


def shrink_server_send_buffer(app, client: socket.socket) -> None:
    """The server's side of `client`'s connection (found through the connection guard) with a small kernel send
    buffer."""
    mine = client.getsockname()[:2]
    for transport in app.state.connections.open:
        if tuple(transport.get_extra_info("peername")[:2]) == mine:
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            return
    raise AssertionError("the server's side of the connection was not found")


def stall_and_read_on(url: str, app, *, guard: bool) -> dict:
    """One client stops reading after its parameters while another runs a session to its end; then the first reads
    again until its socket ends. What each saw."""
    metrics, manager = app.state.metrics, app.state.manager

    async def go() -> dict:
        uri = f"ws://{url}/session/stops-reading?fmt=raw&sdvg=1"
        sock = stalled_socket(url)
        async with websockets.connect(uri, sock=sock, max_queue=1, max_size=2**26) as stalled:
            assert (await recv_json(stalled, 30))["status"] == "ready"
            shrink_server_send_buffer(app, sock)
            if not guard:  # as under a server that gives the app no connection guard (Ray Serve's)
                app.state.connections = None
            session = next(s for s in manager.sockets if s.id == "stops-reading")
            await stalled.send(msgpack.packb({"prompt": "a fox", "num_blocks": 200, "seed": 1}))
            # from here the client reads nothing: its library pauses the socket once one message is queued
            await wait_for(lambda: metrics.stalled._value.get() >= 1, "the stalled socket cut")
            blocks_at_cut = session.blocks_done
            assert session.state == "closed" and session not in manager.sockets  # out of the worker's rotation
            other = await run_session(url, {"prompt": "a hare", "num_blocks": 3, "seed": 2}, fmt="raw",
                                      superset=True, session_id="reads")
            assert session.blocks_done <= blocks_at_cut + 1, "the cut session's blocks stopped (one may be in flight)"
            received, ended = 0, None
            deadline = time.monotonic() + BOUND_S
            while ended is None:  # reading again: what was buffered, then the end of the socket
                assert time.monotonic() < deadline, "the stalled socket ended"
                try:
                    await asyncio.wait_for(stalled.recv(), BOUND_S)
                    received += 1
                except websockets.ConnectionClosed as exc:
                    ended = exc
        return {"other": other, "received": received, "ended": ended, "blocks_at_cut": blocks_at_cut}

    return asyncio.run(go())


@pytest.mark.parametrize("guard", [True, False], ids=["aborted", "closed_when_drained"])
def test_a_client_that_stops_reading_is_cut_and_counted_and_the_others_go_on(tiny_pipe, tmp_path, guard):
    # 16 unsent frames per socket: a block's frames (12 on tiny) fit, so the reading session drops none
    with running_server(tiny_pipe, tmp_path, max_sessions=4, send_buffer_frames=16, send_stall_s=STALL_S) as (url, app):
        seen = stall_and_read_on(url, app, guard=guard)
        metrics = app.state.metrics
        assert metrics.stalled._value.get() == 1  # counted once; the reading session was never cut
        other = seen["other"]
        assert other["texts"][-1]["status"] == "completed"
        assert sorted(set(other["blocks"])) == [0, 1, 2] and len(other["frames"]) == len(other["blocks"])
        stats = [t for t in other["texts"] if t.get("status") == "stats"]
        assert [t["block"] for t in stats] == [0, 1, 2] and stats[-1]["dropped_frames"] == 0  # none of its dropped
        assert 1 <= seen["blocks_at_cut"] < 200  # cut long before its run's end
        assert seen["received"] < seen["blocks_at_cut"] * 13 + 2  # at most what was made (+ ready and params)
        assert isinstance(seen["ended"], websockets.ConnectionClosed)  # its socket ended
        counted = [line for line in metrics.text().decode().splitlines()
                   if line.startswith("sdvg_serve_stalled_clients_total ")]
        assert counted == ["sdvg_serve_stalled_clients_total 1.0"]  # in Prometheus' text


def test_a_socket_closed_while_its_client_stops_reading_is_cut_within_two_seconds(tiny_pipe, tmp_path):
    """The receive loop ends first (here: a refused message spends a one-message budget, --max-refused-messages 1)
    while the send loop still waits on a client that stopped reading: the close waits 2 s for its last sends, then
    the socket is cut and counted as stalled, long before --send-stall-s (60 s here)."""
    with running_server(tiny_pipe, tmp_path, max_sessions=2, send_buffer_frames=16, send_stall_s=60.0,
                        flood_close_after=1) as (url, app):
        metrics, manager = app.state.metrics, app.state.manager

        async def go() -> float:
            sock = stalled_socket(url)
            uri = f"ws://{url}/session/closes-stalled?fmt=raw&sdvg=1"
            async with websockets.connect(uri, sock=sock, max_queue=1, max_size=2**26) as stalled:
                assert (await recv_json(stalled, 30))["status"] == "ready"
                shrink_server_send_buffer(app, sock)
                session = next(s for s in manager.sockets if s.id == "closes-stalled")
                await stalled.send(msgpack.packb({"prompt": "a fox", "num_blocks": 200, "seed": 1}))
                await wait_for(lambda: session.outbox.frames >= 16, "the server's sends blocked (its buffer full)")
                await stalled.send("a text frame: refused, and the budget of one is spent")
                t0 = time.monotonic()
                await wait_for(lambda: metrics.stalled._value.get() >= 1, "the closing socket cut")
                waited = time.monotonic() - t0
                assert session.state == "closed" and session not in manager.sockets
                deadline = time.monotonic() + BOUND_S
                while True:  # reading again: what was buffered, then the end of the socket
                    assert time.monotonic() < deadline, "the cut socket ended"
                    try:
                        await asyncio.wait_for(stalled.recv(), BOUND_S)
                    except websockets.ConnectionClosed:
                        return waited

        waited = asyncio.run(go())
        assert 1.5 <= waited < 30  # its close's 2 s, not --send-stall-s
        assert metrics.stalled._value.get() == 1
