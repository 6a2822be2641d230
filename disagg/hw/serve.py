"""The process body of a server: build the server of its role and run it until Shutdown;
and `serve_node`, one node with all its ranks on this host (what `disagg hw serve` starts)."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import shutil
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
from disagg.hw.ranks import follow, rank_device, rank_dir

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
    exp = Experiment.model_validate(cfg.experiment)
    hw = exp.hw
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
    try:
        server = SERVERS[cfg.role](cfg, control)
    except DisaggError as e:
        control.send("driver", Records(cfg.name, (), (), f"{cfg.name}: {e}"))
        control.close(linger_s=5.0)
        return
    # pinned once built: the weights are drawn on every core, the serving loop runs on its own
    slot = latency.process_slot(exp.cluster, cfg.role, cfg.index)
    latency.apply(hw.latency, slot, rank_device(cfg, exp, 0))
    server.run()


FOLLOWER_EXIT_S = 30.0  # how long a node's followers get to end after its leader has


def serve_node(cfg: NodeConfig) -> None:
    """Node `cfg` on this host, as `disagg hw run` starts one: its leader (rank 0, the server)
    in this process and each follower rank in a process of its own, sharing a directory
    (`rank_dir`) that is removed at the end. Followers that outlive the leader by
    FOLLOWER_EXIT_S are killed (the leader tells them to stop as it ends)."""
    if cfg.ranks == 1:
        serve(cfg)
        return
    cfg = rank_dir(cfg)
    ctx = mp.get_context("spawn")
    followers = [
        ctx.Process(target=follow, args=(cfg, r), name=cfg.rank_name(r), daemon=True)
        for r in range(1, cfg.ranks)
    ]
    try:
        for proc in followers:
            proc.start()
        serve(cfg)
    finally:
        for proc in followers:
            proc.join(FOLLOWER_EXIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(cfg.tp_dir, ignore_errors=True)
