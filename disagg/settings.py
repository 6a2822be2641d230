"""The hw backend's settings, as the experiment's `[hw]` table (`[hw.latency]`, `[hw.cuda]`,
`[hw.verbs]` inside it), and the one place where environment variables are read.

Every setting of a hardware run is a typed field here, so a run's experiment.json records all
of it and `disagg sim run RUN_DIR` replays the run as it ran. Command-line flags and the
`DISAGG_*` variables below are overrides of these fields, applied when the experiment is loaded
(file < environment < `--set` and flags); nothing else reads the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

HW_PAGES = 512  # KV pages per hw server when the experiment leaves kv.pages unset


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LatencyConfig(_Frozen):
    """How the servers trade CPU for latency (docs/gpu-runs.md: what each measured)."""

    # idle servers poll without sleeping (one busy core each) instead of waiting in their poll
    spin: bool = False
    # an idle decoder plans a request's first decode pass when it hands the request to prefill
    plan_ahead: bool = True
    # a server plans its next decode pass while this one runs on the GPU (the same rows one
    # token on, less those it finishes), and uses the plan if that is the next pass
    overlap: bool = True
    # a decode or colocated server launches its next decode pass before it reads this one's
    # tokens, where nothing waits to join (the role's `continuation`): the next pass takes this
    # one's sampled tokens on the device, and the host's work between passes runs while the
    # device does; a request that comes meanwhile joins the pass after (CUDA: decode passes
    # that replay a captured graph; not on a node of several ranks). The simulator runs it too
    chain: bool = False
    # a pass with a prompt chunk of at most max(prefill_graphs) new tokens, all told, replays
    # CUDA graphs of its work between attentions, captured at start for each size here and run
    # at the next size up (disagg.hw.pieces; GQA models on one rank, experts grouped); ():
    # each such pass is launched op by op
    prefill_graphs: tuple[PositiveInt, ...] = ()
    # a prefill posts a pass's metadata when its last layer is seen, ordered after the pass on
    # the wire (the cuda wire's copy stream waits on an event), instead of after a host sync
    meta_in_stream: bool = False
    # FlashInfer's fused RMSNorm, SiLU-and-mul and RoPE instead of torch's kernels (CUDA only)
    fused_ops: bool = True
    # a PM QoS request holding the host's CPU wake-up latency to at most this many microseconds
    # while the servers live (None: not asked)
    cpu_latency_us: int | None = Field(default=None, ge=0)
    # each server process (and each follower rank) pinned to this many cores of its own, taken
    # from the cores nearest its GPU (its NUMA node's) first (0: where the OS places it), once
    # built: the weights are drawn on every core
    cores_per_server: int = Field(default=0, ge=0)
    # the driver pinned to this many cores of its own, the next after the servers', while it
    # drives a run on one host (0: where the OS places it, perhaps on a server's cores)
    driver_cores: int = Field(default=0, ge=0)
    # the pinned cores (servers', then the driver's) begin this many cores into that order:
    # 1 or more leaves the first core, where a host often takes its interrupts, to the OS
    first_core: int = Field(default=0, ge=0)


def pieces_size(sizes: Sequence[int], tokens: int) -> int | None:
    """The padded size a pass of `tokens` new tokens (decodes' included) replays in
    `prefill_graphs` of `sizes`: the smallest that holds it; None if none does (it runs
    eagerly). The hw runner runs it so, and the simulator's profile costs it so."""
    return min((s for s in sizes if s >= tokens), default=None)


class CudaWireConfig(_Frozen):
    """The cuda wire's copy paths (disagg.hw.transport.cuda)."""

    peer_kernels: bool = True  # copy kernels reading the peer's mapped memory
    stack: bool = True  # one batched copy for runs of equal size
    gather: bool = True  # gather scattered runs into one contiguous copy


class VerbsWireConfig(_Frozen):
    """The verbs wire's device (disagg.hw.transport.verbs); None: found from the topology."""

    device: str | None = None  # an ibverbs device name, e.g. mlx5_0
    port: int = Field(default=1, ge=1)
    gid_index: int | None = Field(default=None, ge=0)


class HwConfig(_Frozen):
    """How `disagg hw run` runs the experiment: devices, wire, kernels and time limits."""

    wire: Literal["tcp", "cuda", "verbs"] = "tcp"
    prefill_device: str = "cpu"  # cpu, cuda or cuda:N
    decode_device: str = "cpu"  # also the colocated server's
    # auto (FlashInfer on CUDA, torch on CPU), torch, flashinfer or flashinfer:KERNEL
    attention: str = "auto"
    # MoE experts: two grouped GEMMs where they run (CUDA-graph capturable), or one GEMM pair
    # per expert (the reference; expert parallelism always uses it)
    moe: Literal["grouped", "reference"] = "grouped"
    # a pass of the role's token budget that each server runs and discards before it reports
    # ready, so that no request's pass pays the process's one-time costs (None: on a GPU)
    warm_up: bool | None = None
    bind: str = "tcp://127.0.0.1:*"  # the driver's control socket (loopback by default)
    # the control plane's authentication (docs/security.md): CURVE when a socket binds or
    # connects beyond loopback ("auto"), always ("curve"), or never ("off")
    auth: Literal["auto", "curve", "off"] = "auto"
    # the file holding the shared secret CURVE's keys derive from (only its path is recorded)
    secret_file: str | None = None
    # a directory where servers keep the weights they draw, for later servers of the same
    # model and seed to read instead of drawing again (disagg.hw.weights; None: none kept)
    weight_cache: str | None = None
    start_timeout_s: float = Field(default=600.0, gt=0)  # model build, CUDA graphs, kernel JIT
    drain_timeout_s: float = Field(default=600.0, gt=0)  # after the last arrival
    silent_after_s: float = Field(default=30.0, gt=0)  # a server alive but silent is stuck
    dead_after_s: float = Field(default=5.0, gt=0)  # a peer not heard from this long is dead
    latency: LatencyConfig = LatencyConfig()
    cuda: CudaWireConfig = CudaWireConfig()
    verbs: VerbsWireConfig = VerbsWireConfig()


# every environment variable the project reads, and the field it overrides
ENVIRONMENT: dict[str, str] = {
    "DISAGG_SPIN": "hw.latency.spin",
    "DISAGG_PLAN_AHEAD": "hw.latency.plan_ahead",
    "DISAGG_OVERLAP": "hw.latency.overlap",
    "DISAGG_CHAIN": "hw.latency.chain",
    "DISAGG_META_IN_STREAM": "hw.latency.meta_in_stream",
    "DISAGG_FUSED_OPS": "hw.latency.fused_ops",
    "DISAGG_MOE": "hw.moe",
    "DISAGG_CPU_LATENCY_US": "hw.latency.cpu_latency_us",
    "DISAGG_WIRE_PEER_KERNELS": "hw.cuda.peer_kernels",
    "DISAGG_WIRE_STACK": "hw.cuda.stack",
    "DISAGG_WIRE_GATHER": "hw.cuda.gather",
    "DISAGG_VERBS_DEVICE": "hw.verbs.device",
    "DISAGG_VERBS_PORT": "hw.verbs.port",
    "DISAGG_VERBS_GID_INDEX": "hw.verbs.gid_index",
    "DISAGG_SECRET_FILE": "hw.secret_file",
    "DISAGG_WEIGHT_CACHE": "hw.weight_cache",
}


def environment_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `DISAGG_*` variables set in `environ` (default: this process's), each with the
    `key.path=value` override of the experiment it makes, in ENVIRONMENT's order."""
    env = os.environ if environ is None else environ
    return {
        f"{var}={env[var]}": f"{path}={env[var].strip()}"
        for var, path in ENVIRONMENT.items()
        if var in env
    }
