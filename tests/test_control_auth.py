"""The control plane's authentication: endpoints that share a secret talk over CURVE, anyone
else's messages never arrive; CURVE is on by default beyond loopback; the secret is never
recorded. Real ZeroMQ sockets on loopback, with CURVE forced on (hw.auth="curve")."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")

from disagg.config import build_experiment, load_experiment
from disagg.core.messenger import TransferAborted
from disagg.errors import ConfigError, TransportError
from disagg.hw import auth
from disagg.hw.auth import CurveKeys, control_secret, curve_wanted, is_loopback
from disagg.hw.control import Control, encode
from disagg.hw.protocol import NodeConfig
from disagg.settings import HwConfig

SECRET = b"correct horse battery staple"
OTHER = b"an entirely different secret"
LOOPBACK = "tcp://127.0.0.1:*"
HEARD_NOTHING_S = 0.5  # how long a refused peer is given: it never gets through
DELIVERY_S = 10.0  # generous bound for a message that must arrive


@pytest.fixture
def endpoints() -> Iterator[list[Control]]:
    """Every Control a test makes, closed after it."""
    made: list[Control] = []
    yield made
    for c in made:
        c.close()


def _pair(made: list[Control], server_secret: bytes | None, client_secret: bytes | None):
    server = Control("decode0", LOOPBACK, secret=server_secret)
    client = Control("prefill0", LOOPBACK, secret=client_secret)
    made += [server, client]
    client.connect("decode0", server.endpoint)
    return server, client


def _secret_file(tmp_path: Path, text: bytes = SECRET + b"\n") -> Path:
    path = tmp_path / "control.secret"
    path.write_bytes(text)
    return path


def test_endpoints_sharing_a_secret_talk_both_ways(
    tmp_path: Path, endpoints: list[Control]
) -> None:
    hw = HwConfig(auth="curve", secret_file=str(_secret_file(tmp_path)))
    secret = control_secret(hw, LOOPBACK)
    assert secret == SECRET  # the file's contents, stripped
    server, client = _pair(endpoints, secret, secret)
    server.connect("prefill0", client.endpoint)
    client.send("decode0", TransferAborted(1, "there"))
    assert server.recv(DELIVERY_S) == ("prefill0", TransferAborted(1, "there"))
    server.send("prefill0", TransferAborted(2, "and back"))
    assert client.recv(DELIVERY_S) == ("decode0", TransferAborted(2, "and back"))
    assert server.dropped == client.dropped == 0


@pytest.mark.parametrize(
    ("server_secret", "client_secret"),
    [(SECRET, OTHER), (SECRET, None), (None, SECRET)],
    ids=["another-secret", "no-secret", "server-without-the-secret"],
)
def test_a_peer_without_the_same_secret_never_delivers_a_message(
    server_secret: bytes | None, client_secret: bytes | None, endpoints: list[Control]
) -> None:
    server, stranger = _pair(endpoints, server_secret, client_secret)
    stranger.send("decode0", TransferAborted(1, "let me in"))
    assert server.recv(HEARD_NOTHING_S) is None
    # the server still hears those it should; the stranger's message never came, not even
    # to be dropped
    friend = Control("driver", LOOPBACK, secret=server_secret)
    endpoints.append(friend)
    friend.connect("decode0", server.endpoint)
    friend.send("decode0", TransferAborted(2, "a friend"))
    assert server.recv(DELIVERY_S) == ("driver", TransferAborted(2, "a friend"))
    assert server.recv(HEARD_NOTHING_S) is None
    assert server.dropped == 0


def test_a_client_that_knows_the_public_key_but_not_the_secret_is_refused(
    endpoints: list[Control],
) -> None:
    """CURVE alone lets any client that knows the server's public key in; ZAP admits only
    the one keypair that the secret derives."""
    server = Control("decode0", LOOPBACK, secret=SECRET)
    endpoints.append(server)
    sock = server.ctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, CurveKeys.from_secret(SECRET).public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.IDENTITY, b"driver")
    sock.setsockopt(zmq.LINGER, 0)
    # a DEALER's send blocks while it has no peer: once the refused handshake has dropped the
    # connection it has none, so the send may time out (the message never left)
    sock.setsockopt(zmq.SNDTIMEO, int(HEARD_NOTHING_S * 1000))
    try:
        sock.connect(server.endpoint)
        with contextlib.suppress(zmq.Again):
            sock.send_multipart(encode(TransferAborted(1, "forged")))
        assert server.recv(HEARD_NOTHING_S) is None
    finally:
        sock.close(0)
    assert server.dropped == 0


def test_binding_every_interface_turns_curve_on_by_default(
    tmp_path: Path, endpoints: list[Control]
) -> None:
    hw = HwConfig(secret_file=str(_secret_file(tmp_path)))  # auth "auto"
    bind = "tcp://0.0.0.0:*"
    try:
        server = Control("decode0", bind, secret=control_secret(hw, bind))
    except TransportError as e:
        pytest.skip(f"cannot bind every interface here: {e}")
    endpoints.append(server)
    port = server.endpoint.rsplit(":", 1)[1]
    friend = Control("prefill0", LOOPBACK, secret=control_secret(hw, LOOPBACK, server.endpoint))
    stranger = Control("driver", LOOPBACK, secret=control_secret(HwConfig(), LOOPBACK))
    endpoints += [friend, stranger]
    assert stranger.secret is None  # loopback only: no authentication
    for c in (friend, stranger):
        c.connect("decode0", f"tcp://127.0.0.1:{port}")
    stranger.send("decode0", TransferAborted(1, "unauthenticated"))
    friend.send("decode0", TransferAborted(2, "authenticated"))
    assert server.recv(DELIVERY_S) == ("prefill0", TransferAborted(2, "authenticated"))
    assert server.recv(HEARD_NOTHING_S) is None


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:*", True),
        ("tcp://127.3.2.1:7000", True),
        ("tcp://localhost:7000", True),
        ("tcp://[::1]:7000", True),
        ("ipc:///tmp/disagg.sock", True),
        ("inproc://control", True),
        ("tcp://0.0.0.0:*", False),
        ("tcp://*:7000", False),
        ("tcp://[::]:7000", False),
        ("tcp://10.0.0.5:7000", False),
        ("tcp://host-a:7000", False),
        ("tcp://eth0:7000", False),
        ("tcp://127.0.0.1:0;10.0.0.5:7000", False),  # a connect from a loopback source
    ],
)
def test_loopback_is_this_host_only(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


def test_auto_runs_curve_beyond_loopback_only() -> None:
    assert not curve_wanted("auto", LOOPBACK)
    assert not curve_wanted("auto", LOOPBACK, "tcp://127.0.0.1:7000")
    assert curve_wanted("auto", "tcp://0.0.0.0:*")
    assert curve_wanted("auto", LOOPBACK, "tcp://10.0.0.5:7000")  # a driver on another host
    assert curve_wanted("curve", LOOPBACK)
    assert not curve_wanted("off", "tcp://0.0.0.0:*")
    with pytest.raises(ConfigError, match=r"hw\.auth='tls': use auto, curve or off"):
        curve_wanted("tls", LOOPBACK)
    assert HwConfig().auth == "auto" and HwConfig().bind == LOOPBACK


def test_a_secret_comes_from_the_driver_the_file_or_a_fresh_draw(tmp_path: Path) -> None:
    curve = HwConfig(auth="curve")
    assert control_secret(HwConfig(), LOOPBACK) is None
    assert control_secret(curve, LOOPBACK, given=OTHER) == OTHER  # handed down by the driver
    drawn = {control_secret(curve, LOOPBACK, generate=True) for _ in range(2)}
    assert len(drawn) == 2 and all(s is not None and len(s) == 32 for s in drawn)
    _secret_file(tmp_path)
    relative = HwConfig(auth="curve", secret_file="control.secret")  # from the experiment's dir
    assert control_secret(relative, LOOPBACK, base_dir=str(tmp_path)) == SECRET
    assert control_secret(relative, LOOPBACK, base_dir=str(tmp_path), generate=True) == SECRET


def test_hw_auth_off_beyond_loopback_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    assert control_secret(HwConfig(auth="off"), "tcp://0.0.0.0:7000") is None
    assert "hw.auth=off: no authentication on tcp://0.0.0.0:7000" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("endpoints", "said"),
    [
        (
            ("tcp://0.0.0.0:*",),
            "binding to tcp://0.0.0.0:* needs a shared secret: "
            "set hw.secret_file (or DISAGG_SECRET_FILE)",
        ),
        (
            (LOOPBACK, "tcp://10.0.0.5:7000"),
            "connecting to tcp://10.0.0.5:7000 needs a shared secret: "
            "set hw.secret_file (or DISAGG_SECRET_FILE)",
        ),
    ],
)
def test_beyond_loopback_without_a_secret_is_a_clear_error(
    endpoints: tuple[str, ...], said: str
) -> None:
    with pytest.raises(ConfigError) as e:
        control_secret(HwConfig(), *endpoints)
    assert str(e.value) == said
    with pytest.raises(ConfigError, match=r"^hw.auth='curve' needs a shared secret: set hw"):
        control_secret(HwConfig(auth="curve"), LOOPBACK)


def test_a_bad_secret_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=rf"^hw.secret_file='{re.escape(str(missing))}': cannot"):
        control_secret(HwConfig(auth="curve", secret_file=str(missing)), LOOPBACK)
    short = _secret_file(tmp_path, b"  too short \n")
    said = rf"^hw.secret_file='{re.escape(str(short))}' holds 9 bytes: .* at least 16"
    with pytest.raises(ConfigError, match=said):
        control_secret(HwConfig(auth="curve", secret_file=str(short)), LOOPBACK)
    with pytest.raises(ConfigError, match="needs at least 16 bytes, not 3"):
        Control("decode0", secret=b"abc")


def test_the_environment_names_the_secret_file_and_only_its_path_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _secret_file(tmp_path)
    monkeypatch.setenv("DISAGG_SECRET_FILE", str(path))
    exp = load_experiment(None, ["hw.auth=curve"])
    assert (exp.hw.auth, exp.hw.secret_file) == ("curve", str(path))
    dumped = exp.model_dump_json()
    assert str(path) in dumped and SECRET.decode() not in dumped
    keys = CurveKeys.from_secret(SECRET)
    cfg = NodeConfig("decode", 0, exp.model_dump(mode="json"), "tcp://127.0.0.1:1", secret=SECRET)
    for text in (repr(cfg), repr(keys)):
        assert SECRET.decode() not in text and keys.secret.decode() not in text


def test_every_holder_of_a_secret_derives_one_keypair() -> None:
    keys = CurveKeys.from_secret(SECRET)
    assert keys == CurveKeys.from_secret(SECRET) != CurveKeys.from_secret(OTHER)
    assert len(keys.public) == len(keys.secret) == 40
    assert zmq.curve_public(keys.secret) == keys.public


# -- whole runs: a driver, its servers, and one started by hand


def _tiny(tmp_path: Path) -> dict:
    pytest.importorskip("torch")
    data = {
        "name": "tiny-curve",
        "seed": 5,
        "model": {"name": "tiny-gqa", "weight_dtype": "bf16"},
        "cluster": {
            "mode": "disagg",
            "prefill": {"nodes": 1, "tp": 1, "token_budget": 8},
            "decode": {"nodes": 1, "tp": 1, "max_batch": 8},
        },
        "kv": {"page_size": 4, "layout": "HND"},
        "workload": {
            "rate_per_s": 50,
            "num_requests": 3,
            "prompt_tokens": {"dist": "uniform", "low": 6, "high": 20},
            "output_tokens": {"dist": "uniform", "low": 2, "high": 4},
        },
    }
    (tmp_path / "e.json").write_text(json.dumps(data))
    return data


def test_a_curve_run_hands_its_drawn_secret_to_its_servers_and_records_none_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from disagg.hw.driver import run_hw

    drawn = b"drawn-by-the-driver-for-its-children"
    monkeypatch.setattr(auth.secrets, "token_bytes", lambda n: drawn)
    exp = build_experiment(_tiny(tmp_path), ["hw.wire=tcp", "kv.pages=128", "hw.auth=curve"])
    summary, state = run_hw(exp, tmp_path / "out")
    assert len(state.finished) == 3
    assert all(f.status == "finished" for f in state.finished.values())
    assert summary["messages_dropped"] == 0
    recorded = json.loads((tmp_path / "out" / "experiment.json").read_text())
    assert recorded["hw"]["auth"] == "curve" and recorded["hw"]["secret_file"] is None
    public = CurveKeys.from_secret(drawn)
    for f in (tmp_path / "out").iterdir():
        content = f.read_bytes()
        assert drawn not in content and public.secret not in content, f.name


def _serve(tmp_path: Path, *args: str) -> list[str]:
    """`disagg hw serve` of the tiny experiment's decode server, with `args` added."""
    return [
        sys.executable,
        "-m",
        "disagg.cli",
        "hw",
        "serve",
        str(tmp_path / "e.json"),
        "--role",
        "decode",
        "--pages",
        "128",
        *args,
    ]


def test_a_server_started_by_hand_joins_with_the_secret_file(tmp_path: Path) -> None:
    import os
    import threading

    from disagg.hw.driver import Driver

    data = _tiny(tmp_path)
    path = _secret_file(tmp_path)
    exp = build_experiment(data, ["kv.pages=128", "hw.auth=curve", f"hw.secret_file={path}"])
    driver = Driver(exp, external=("decode0",))
    env = os.environ | {"DISAGG_SECRET_FILE": str(path)}
    cmd = _serve(tmp_path, "--driver", driver.control.endpoint, "--set", "hw.auth=curve")
    proc = subprocess.Popen(cmd, env=env)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        driver.start()
        state = driver.replay()
    finally:
        driver.stop()
        proc.wait(30)
        watchdog.cancel()
    assert len(state.finished) == 3
    assert all(f.status == "finished" for f in state.finished.values())
    assert proc.returncode == 0


def test_hw_serve_beyond_loopback_without_a_secret_says_what_to_set(tmp_path: Path) -> None:
    import os

    _tiny(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "DISAGG_SECRET_FILE"}
    cmd = _serve(tmp_path, "--driver", "tcp://127.0.0.1:7000", "--bind", "tcp://0.0.0.0:*")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # the CLI's exit code for an error a user can fix
    assert (
        "binding to tcp://0.0.0.0:* needs a shared secret: set hw.secret_file "
        "(or DISAGG_SECRET_FILE)"
    ) in proc.stdout + proc.stderr


def test_a_driver_with_servers_started_elsewhere_needs_the_secret_file(tmp_path: Path) -> None:
    from disagg.hw.driver import Driver

    exp = build_experiment(_tiny(tmp_path), ["kv.pages=128", "hw.bind=tcp://0.0.0.0:7000"])
    with pytest.raises(ConfigError, match=r"^binding to tcp://0.0.0.0:7000 needs a shared"):
        Driver(exp, external=("decode0",))
