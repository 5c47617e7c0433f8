"""`sdvg serve` starts right: its port is checked at parse time, bound before any model loads, and the real
port of `--port 0` is the one printed (the whole server on `--port 0`: tests/test_serve_sigterm.py)."""
from __future__ import annotations

import re
import socket

import pytest

pytest.importorskip("fastapi")

from sdvg.cli.main import main  # noqa: E402


@pytest.mark.parametrize("port", ["99999", "65536", "-1", "eighty"])
def test_a_port_out_of_range_is_refused_at_parse_time(port, capsys):
    def loader(args):
        raise AssertionError("no model may load")

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--preset", "tiny", "--port", port, "--quiet"], load_pipeline=loader)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--port" in err and "0 to 65535" in err, err


def test_a_taken_port_is_refused_before_any_model_loads(capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        loaded = []
        assert main(["serve", "--preset", "tiny", "--port", str(port), "--quiet"],
                    load_pipeline=lambda args: loaded.append(args)) == 2
    assert not loaded
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen there" in err and "choose another --port" in err, err


def test_port_0_is_bound_before_loading_and_its_real_port_printed(monkeypatch, capsys):
    import sdvg.serve.app
    import sdvg.serve.server

    seen = {}

    def loader(args):  # the socket is already bound: nothing else may bind its port now
        seen["loaded"] = True
        return object()

    def fake_serve(app, cfg, log_level, sock):
        seen["port"] = sock.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", seen["port"]))

    monkeypatch.setattr(sdvg.serve.app, "create_app", lambda pipe, cfg, defaults: "app")
    monkeypatch.setattr(sdvg.serve.server, "serve", fake_serve)
    assert main(["serve", "--preset", "tiny", "--port", "0"], load_pipeline=loader) == 0
    assert seen["loaded"] and seen["port"] > 0
    printed = re.search(r"sdvg serve: http://127\.0\.0\.1:(\d+)/", capsys.readouterr().err)
    assert printed and int(printed.group(1)) == seen["port"]


def test_port_0_with_ray_is_refused_before_loading(capsys):
    assert main(["serve", "--preset", "tiny", "--port", "0", "--ray-replicas", "2", "--quiet"],
                load_pipeline=lambda args: pytest.fail("no model may load")) == 2
    assert "--port 0 with --ray-replicas" in capsys.readouterr().err


def test_a_server_that_never_starts_is_a_runtime_failure(monkeypatch, capsys):
    import uvicorn

    import sdvg.serve.app

    monkeypatch.setattr(sdvg.serve.app, "create_app", lambda pipe, cfg, defaults: "app")
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # returns without starting
    assert main(["serve", "--preset", "tiny", "--port", "0", "--quiet"], load_pipeline=lambda args: object()) == 1
    assert "the server did not start" in capsys.readouterr().err


def test_the_send_stall_flag_reaches_the_config_and_a_non_positive_one_is_refused(capsys):
    from sdvg.cli.serve import config_of

    seen = []

    def loader(args):
        seen.append(config_of(args).send_stall_s)
        raise SystemExit(0)  # nothing loads

    with pytest.raises(SystemExit):
        main(["serve", "--preset", "tiny", "--port", "0", "--send-stall-s", "2.5", "--quiet"], load_pipeline=loader)
    assert seen == [2.5]
    assert main(["serve", "--preset", "tiny", "--port", "0", "--send-stall-s", "0", "--quiet"],
                load_pipeline=loader) == 2
    assert "send_stall_s 0.0 must be > 0" in capsys.readouterr().err
