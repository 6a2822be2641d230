"""The process body of a server: build the server of its role and run it until Shutdown."""

from __future__ import annotations

import faulthandler
import signal

from disagg.config import Experiment
from disagg.errors import DisaggError
from disagg.hw import latency
from disagg.hw.auth import control_secret
from disagg.hw.control import Control
from disagg.hw.decode import ColocatedServer, DecodeServer
from disagg.hw.node import Server
from disagg.hw.prefill import PrefillServer
from disagg.hw.protocol import NodeConfig, Records

SERVERS: dict[str, type[Server]] = {
    "prefill": PrefillServer,
    "decode": DecodeServer,
    "colocated": ColocatedServer,
}


def serve(cfg: NodeConfig) -> None:
    """Build the server for `cfg.role` and run it until Shutdown. A server that cannot be
    built (no GPU, too little memory, a missing library) tells the driver why."""
    # one control endpoint, made first: a second one under the same name would be refused by
    # the driver's socket while the first lives, and the reason with it
    hw = Experiment.model_validate(cfg.experiment).hw
    control = Control(
        cfg.name,
        cfg.bind,
        dead_after_s=hw.dead_after_s,
        allowed=cfg.senders,
        secret=control_secret(
            hw, cfg.bind, cfg.driver, given=cfg.secret, base_dir=cfg.experiment.get("base_dir", ".")
        ),
    )
    control.connect("driver", cfg.driver)
    if hasattr(signal, "SIGUSR1"):  # a driver that finds this server stuck asks where it is
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    latency.apply(hw.latency)
    try:
        server = SERVERS[cfg.role](cfg, control)
    except DisaggError as e:
        control.send("driver", Records(cfg.name, (), (), f"{cfg.name}: {e}"))
        control.close(linger_s=5.0)
        return
    server.run()
