"""Experiment files (TOML) -> validated, frozen configuration objects.

An experiment names a model, the hardware, the cluster (colocated nodes, or prefill and decode
node groups), the KV pages, the transfer policy, speculative decoding, the cost model and the
workload. Every field has a default, so `Experiment()` is the built-in default experiment.
`load_experiment(path, overrides)` applies `key.path=value` overrides (the CLI's `--set`) before
validation, so a bad override gets the same clear error as a bad file.
"""

from __future__ import annotations

import itertools
import json
import math
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from disagg import faults
from disagg.core.policies import LeastLoadedConfig, RouterConfig, SchedulerConfig, scheduler_for
from disagg.core.workload import Arrival, LengthDist, WorkloadConfig, refuse_too_long
from disagg.errors import ConfigError
from disagg.faults import Fault
from disagg.hardware import GPU, NIC, Node, from_table, get_gpu, get_nic
from disagg.hf_config import default_name, read_hf_config
from disagg.models import ModelSpec, get_model
from disagg.settings import HwConfig, environment_overrides


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Frozen):
    """A catalogue model by `name`, or the Hugging Face config.json at `config` (a path; the
    experiment resolves a relative one from its base_dir), which `name` then labels (default:
    the file's directory): disagg.hf_config reads it."""

    config: str | None = None
    name: str = "deepseek-r1"
    weight_dtype: Literal["bf16", "fp8"] = "fp8"
    kv_dtype: Literal["bf16", "fp8"] = "bf16"
    layers: int | None = Field(default=None, ge=1)  # cut the depth (hardware runs)
    # the seed of the hw model's random weights (None: the experiment's seed)
    weight_seed: int | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _name_of_config(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("config"), str) and "name" not in data:
            return {**data, "name": default_name(data["config"])}
        return data

    @field_validator("config")
    @classmethod
    def _readable(cls, v: str | None) -> str | None:
        if v is not None:
            read_hf_config(v)
        return v

    @field_validator("name")
    @classmethod
    def _known(cls, v: str, info: ValidationInfo) -> str:
        if "config" not in info.data or info.data["config"] is not None:
            return v  # a label of the config.json (or the file failed: its error says why)
        if v.endswith(".json"):
            raise ValueError(f"{v!r} is a file: give a Hugging Face config.json as model.config")
        get_model(v)
        return v

    @property
    def spec(self) -> ModelSpec:
        if self.config is None:
            spec = get_model(self.name)
        else:
            spec = read_hf_config(self.config, self.name)
        return spec.with_layers(self.layers) if self.layers else spec


class HardwareConfig(_Frozen):
    """`gpu` and `nic` name catalogue entries, or are tables of every field of a custom one
    (disagg.hardware.from_table); a run's experiment.json records the table, so it replays."""

    gpu: str | GPU = "H200-SXM"
    nic: str | NIC = "ConnectX-7"
    gpus_per_node: int = Field(default=8, ge=1)
    nics_per_node: int = Field(default=8, ge=1)

    @field_validator("gpu", mode="before")
    @classmethod
    def _gpu(cls, v: Any) -> Any:
        return _hardware_entry(GPU, get_gpu, v)

    @field_validator("nic", mode="before")
    @classmethod
    def _nic(cls, v: Any) -> Any:
        return _hardware_entry(NIC, get_nic, v)

    @property
    def node(self) -> Node:
        return Node(self.gpu_spec, self.nic_spec, self.gpus_per_node, self.nics_per_node)

    @property
    def gpu_spec(self) -> GPU:
        return get_gpu(self.gpu) if isinstance(self.gpu, str) else self.gpu

    @property
    def nic_spec(self) -> NIC:
        return get_nic(self.nic) if isinstance(self.nic, str) else self.nic


def _hardware_entry(kind: type[Any], lookup: Callable[[str], Any], v: Any) -> Any:
    """A catalogue name (checked), a custom entry from a table, or an entry as it is."""
    if isinstance(v, str):
        lookup(v)
        return v
    if isinstance(v, dict):
        return from_table(kind, v)
    if isinstance(v, kind):
        return v
    raise ValueError(f"give a catalogue {kind.__name__} name or a table of its fields, not {v!r}")


class GroupConfig(_Frozen):
    """Nodes of one role and how each one runs the model."""

    nodes: int = Field(default=1, ge=1)
    tp: int = Field(default=8, ge=1)  # tensor-parallel ranks per attention group
    dp: int = Field(default=1, ge=1)  # data-parallel attention groups per node
    # an MoE model's routed experts split whole across the node's tp x dp ranks, not each
    # expert's width; the simulator costs the experts spread over the node's GPUs either way
    expert_parallel: bool = False
    max_batch: int = Field(default=256, ge=1)  # sequences per forward pass
    token_budget: int = Field(default=8192, ge=1)  # tokens per forward pass (chunked prefill)
    scheduler: SchedulerConfig | None = None  # batch policy; None: the role's default

    @property
    def gpus_per_node(self) -> int:
        return self.tp * self.dp


class ClusterConfig(_Frozen):
    mode: Literal["colocated", "disagg"] = "disagg"
    colocated: GroupConfig = GroupConfig(nodes=4)
    prefill: GroupConfig = GroupConfig(nodes=1)
    decode: GroupConfig = GroupConfig(nodes=3)
    router: RouterConfig = LeastLoadedConfig()  # a policy name or a [cluster.router] table
    # every node on one GPU, as a hw run on a single device records: passes of different nodes
    # that overlap share it (disagg/sim/gpu.py); false: each node has GPUs of its own
    shared_gpu: bool = False
    # there, a decode-only pass's share of the GPU beside one pass with a prompt chunk, and
    # that pass's beside it; unset, 1 - decode_share: the GPU's work conserved (sim/gpu.py;
    # disagg validate measures both)
    decode_share: float = Field(default=0.5, gt=0.0, lt=1.0)
    prefill_share: float | None = Field(default=None, gt=0.0, le=1.0)
    # and the work a pass with a prompt chunk adds there once it meets another node's pass, at
    # its start or later: a fixed cost of sharing, whatever the chunk (sim/gpu.py; disagg
    # validate fits it)
    chunk_extra_s: float = Field(default=0.0, ge=0.0)
    # (seconds, factor) points, seconds increasing: a pass whose work takes `seconds` alone adds
    # chunk_extra_s times the factor interpolated at its time alone, held at the ends (disagg
    # validate measures it from the passes); (): every pass adds chunk_extra_s
    chunk_extra_shape: tuple[tuple[float, float], ...] = ()
    # and its factor where the first decode pass a chunk pass meets has more than 16 sequences,
    # whose host issues its copies in more groups, so that it yields the GPU once more a pass
    # (sim/gpu.py's EXTRA_YIELD_SEQS; disagg validate measures it from the passes)
    chunk_extra_wide: float = Field(default=1.0, ge=0.0)
    # (seconds, factor) points like chunk_extra_shape: a decode-only pass beside a pass with a
    # prompt chunk whose work takes `seconds` alone weighs decode_share times the factor there
    # (disagg validate measures it: on one H100 a Llama-3.1-8B decode pass ran at 0.62 of its
    # pace alone beside a chunk pass of 13 ms alone, 0.53 beside 26 ms, 0.40 beside 45 ms);
    # (): decode_share beside any
    decode_share_shape: tuple[tuple[float, float], ...] = ()
    # and its factor for a decode pass of more than 16 sequences, which yields the GPU once
    # more a pass (sim/gpu.py's EXTRA_YIELD_SEQS); disagg validate measures it from a chained
    # decode server's passes (hw.latency.chain), and leaves 1 for an unchained one
    decode_share_wide: float = Field(default=1.0, gt=0.0)
    # set: the passes there take turns kernel by kernel instead, each advancing at its time
    # alone over all theirs plus switch_s for every two passes (round robin, sim/gpu.py), and
    # the shares are unused; disagg validate measures it
    switch_s: float | None = Field(default=None, ge=0.0)
    # set: the passes there take turns as the GPU's time-slicer gives them (turns rule,
    # sim/gpu.py): a chunk pass a layer a turn, a decode pass this much device time a turn and a
    # turn's yield before and after its device time, switch_s (or nothing) between turns
    turn_slice_s: float | None = Field(default=None, gt=0.0)

    @field_validator("chunk_extra_shape", "decode_share_shape")
    @classmethod
    def _shape_points(cls, v: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        """Seconds from 0 up, each above the one before; factors finite and not below 0."""
        seconds = [s for s, _ in v]
        rising = all(a < b for a, b in itertools.pairwise(seconds))
        if not rising or min(seconds, default=0.0) < 0 or not all(0 <= f < math.inf for _, f in v):
            raise ValueError(
                f"{[list(p) for p in v]}: give (seconds, factor) points, seconds from 0 up and "
                "increasing, factors of 0 or more"
            )
        return v

    @model_validator(mode="after")
    def _scheduler_roles(self) -> ClusterConfig:
        groups = {"colocated": self.colocated, "prefill": self.prefill, "decode": self.decode}
        for role, group in groups.items():  # used in this mode or not: each names its role
            scheduler_for(role, group.scheduler)
        return self

    @model_validator(mode="after")
    def _no_unused_groups(self) -> ClusterConfig:
        """A group the mode does not run, given explicitly with other than its default values,
        would be ignored without a word: an error naming it. A group at its default is not: a
        complete dump (a run's experiment.json, an experiment an override is applied to) lists
        every group, the unused ones at their defaults."""
        ignored = [
            f"cluster.{name}"
            for name in ("colocated", "prefill", "decode")
            if name not in self.groups
            and name in self.model_fields_set
            and getattr(self, name) != type(self).model_fields[name].default
        ]
        if ignored:
            other = "disagg" if self.mode == "colocated" else "colocated"
            names, used = " and ".join(ignored), " and ".join(f"cluster.{g}" for g in self.groups)
            raise ValueError(
                f"{names} set, but cluster.mode={self.mode!r} runs only {used}: remove {names} "
                f"from the experiment (or the --set overrides), or use cluster.mode={other!r}"
            )
        return self

    @property
    def groups(self) -> dict[str, GroupConfig]:
        if self.mode == "colocated":
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}

    @property
    def total_gpus(self) -> int:
        return sum(g.nodes * g.gpus_per_node for g in self.groups.values())


class KVConfig(_Frozen):
    page_size: int = Field(default=64, ge=1)  # tokens per page
    layout: Literal["HND", "NHD"] = "HND"
    memory_fraction: float = Field(default=0.9, gt=0, le=1)  # of HBM for weights + KV
    activation_reserve_gb: float = Field(default=8.0, ge=0)  # per GPU, for activations/graphs
    # KV pages per node, in both backends; None: the simulator fills the HBM that weights and
    # the reserve leave, and a hardware run takes settings.HW_PAGES (and records that number)
    pages: int | None = Field(default=None, ge=1)


class TransferConfig(_Frozen):
    policy: Literal["layerwise", "whole"] = "layerwise"
    # decode-first: the decoder reserves pages, then hands the request to prefill; parallel: the
    # router sends it to both, prefill starts at once and sends its KV once the pages are known
    handoff: Literal["decode-first", "parallel"] = "decode-first"
    # a control message's hop: the driver's request to its server, and each between servers
    control_latency_s: float = Field(default=100e-6, ge=0)
    timeout_s: float = Field(default=30.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)


class SpecConfig(_Frozen):
    """Speculative decoding / MTP: each decode step verifies `draft_tokens` drafts and emits
    `accepted_tokens_per_step` tokens on average (1 without speculation)."""

    draft_tokens: int = Field(default=0, ge=0)
    accepted_tokens_per_step: float = Field(default=1.0, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> SpecConfig:
        if self.accepted_tokens_per_step > self.draft_tokens + 1:
            raise ValueError(
                f"accepted_tokens_per_step={self.accepted_tokens_per_step} cannot exceed "
                f"draft_tokens + 1 = {self.draft_tokens + 1}"
            )
        return self


class CostConfig(_Frozen):
    """Roofline efficiency factors (fractions of peak) and fixed costs, or a measured profile
    table (disagg.sim.costmodel gives the formulas).

    A collective over p ranks costs `collective_latency_s` + steps * `collective_step_latency_s`
    (2(p-1) steps for an all-reduce, p-1 for an all-to-all) plus its bytes on the wire over
    NVLink at `allreduce_efficiency`. With `allreduce_in_switch` (NVLink SHARP, as NCCL runs an
    all-reduce on H100/H200 NVSwitch systems) each rank sends and receives the message once;
    without it, a ring sends 2(p-1)/p of it. The defaults are chosen so that a 64 MB TP8
    all-reduce on H200 takes about 0.2 ms and a 0.1-2 MB one 20-40 us, as NCCL does.
    """

    source: str = "roofline"  # or "profile:PATH" (a CSV written by `disagg hw profile`)
    gemm_efficiency: float = Field(default=0.7, gt=0, le=1)
    attention_efficiency: float = Field(default=0.6, gt=0, le=1)
    memory_efficiency: float = Field(default=0.7, gt=0, le=1)
    allreduce_efficiency: float = Field(default=0.8, gt=0, le=1)  # of NVLink, per direction
    allreduce_in_switch: bool = True
    collective_latency_s: float = Field(default=8e-6, ge=0)  # per collective: launch, sync
    collective_step_latency_s: float = Field(default=1e-6, ge=0)  # per peer step
    # elementwise kernels (two norms, two residual adds, RoPE) read or write each token's
    # hidden state this many times per layer, from HBM at memory_efficiency
    elementwise_hidden_passes: float = Field(default=12.0, ge=0)
    step_overhead_s: float = Field(default=0.003, ge=0)  # per pass: scheduling, sampling
    # with a profile: the serving loop's own time between passes, and (if set) the host time
    # per pass, replacing the profile's host_s: fixed for a decode pass or for one with a
    # prompt chunk, plus per sequence (`disagg validate` measures them on a serving run)
    profile_pass_overhead_s: float = Field(default=0.0, ge=0)
    profile_host_s: float | None = Field(default=None, ge=0)
    profile_host_chunk_s: float = Field(default=0.0, ge=0)
    profile_host_per_seq_s: float = Field(default=0.0, ge=0)
    # and where given, a mixed pass's (a chunk beside decodes): fixed plus per decode (none: a
    # pass with a chunk's, per sequence as a decode pass)
    profile_host_mixed_s: float | None = Field(default=None, ge=0)
    profile_host_mixed_per_seq_s: float = Field(default=0.0, ge=0)
    # on a GPU the nodes share in turns (cluster.switch_s): the part of a pass's host time
    # that comes before its device time, the rest after (`disagg validate` measures it where
    # the hw runs say when each forward was launched)
    profile_host_before: float = Field(default=1.0, ge=0, le=1)
    # with a profile: a chained decode pass's time beyond its device time (hw.latency.chain:
    # the GPU's work outside the passes' device events, sampling and copies), fixed plus per
    # sequence (`disagg validate` measures them on the chained passes of a serving run)
    profile_chain_s: float = Field(default=0.0, ge=0)
    profile_chain_per_seq_s: float = Field(default=0.0, ge=0)
    # with a profile: (chunk tokens, s) points, the device time a serving run's passes with a
    # prompt chunk took beyond the profile's cost of them (`disagg validate` measures them)
    profile_chunk_offsets: tuple[tuple[float, float], ...] = ()
    # with a profile: a disaggregated decode node's device time per pass over the profile's
    # (`disagg validate` measures it: its decode server's passes beside no prefill pass over
    # the profile's at their shape, graph scales and all)
    profile_decode_scale: float = Field(default=1.0, gt=0)
    # with a profile: (s, fraction) points, how much longer than the profile a colocated
    # node's decode-only pass runs on the device by the time since its last pass with a prompt
    # chunk ended, none from the last point on (`disagg validate` measures them)
    profile_after_chunk: tuple[tuple[float, float], ...] = ()
    # with a profile: (batch, factor) points, a decode-only pass replayed in a CUDA graph
    # runs the factor of its batch (interpolated over the points in its graph) x the
    # profile's device time (`disagg validate` measures them on passes long after a chunk pass)
    profile_graph_scales: tuple[tuple[float, float], ...] = ()
    # with a profile: (batch, factor) points like profile_graph_scales, a disaggregated decode
    # node's in their place, on top of profile_decode_scale (`disagg validate` measures them on
    # its decode server's passes beside no prefill pass: on one GPU, Qwen3-30B-A3B's ran 5-6%
    # faster than the profile at 1-2 sequences, and as fast at 6-25)
    profile_decode_graph_scales: tuple[tuple[float, float], ...] = ()
    layer_overhead_s: float = Field(default=15e-6, ge=0)  # per layer: launch gaps

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if v != "roofline" and not v.startswith("profile:"):
            raise ValueError(f"cost model {v!r}: use 'roofline' or 'profile:PATH'")
        return v


DEFAULT_WORKLOAD = WorkloadConfig(
    rate_per_s=3.0,
    duration_s=120.0,
    prompt_tokens=LengthDist(dist="lognormal", mean=3000, sigma=0.5, low=256, high=16384),
    output_tokens=LengthDist(dist="uniform", low=300, high=1000),
)


class Experiment(_Frozen):
    name: str = "default"
    description: str = ""
    seed: int = 0
    model: ModelConfig = ModelConfig()
    hardware: HardwareConfig = HardwareConfig()
    cluster: ClusterConfig = ClusterConfig()
    kv: KVConfig = KVConfig()
    transfer: TransferConfig = TransferConfig()
    spec: SpecConfig = SpecConfig()
    cost: CostConfig = CostConfig()
    workload: WorkloadConfig = DEFAULT_WORKLOAD
    hw: HwConfig = HwConfig()  # how `disagg hw run` runs it (the simulator ignores it)
    faults: tuple[Fault, ...] = ()  # injected in both backends (disagg.faults)
    base_dir: str = "."  # where relative paths (traces, profiles) resolve; set by the loader

    @model_validator(mode="before")
    @classmethod
    def _model_config_path(cls, data: Any) -> Any:
        """A relative model.config resolves from base_dir (the experiment file's directory);
        the experiment records it absolute, so a run's experiment.json replays anywhere."""
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, dict):
            return data
        path = model.get("config")
        if not isinstance(path, str) or Path(path).is_absolute():
            return data
        full = (Path(str(data.get("base_dir", "."))) / path).resolve()
        return {**data, "model": {**model, "config": str(full)}}

    @property
    def weight_seed(self) -> int:
        """The seed of the hw model's random weights: `model.weight_seed`, else `seed`."""
        return self.seed if self.model.weight_seed is None else self.model.weight_seed

    def updated(self, *overrides: str) -> Experiment:
        """This experiment with `key.path=value` overrides applied (as `--set` applies them)."""
        return _override(self, list(overrides), f"experiment {self.name!r} with {overrides}")

    @model_validator(mode="after")
    def _parallelism(self) -> Experiment:
        spec = self.model.spec
        for role, group in self.cluster.groups.items():
            try:
                spec.check_tp(group.tp)
            except ConfigError as e:
                raise ValueError(f"cluster.{role}: {e}") from None
            if group.expert_parallel and not spec.is_moe:
                raise ValueError(
                    f"cluster.{role}.expert_parallel=true, but {spec.name} has no routed experts"
                )
            if group.expert_parallel and spec.experts % group.gpus_per_node:
                raise ValueError(
                    f"cluster.{role}.expert_parallel=true: {group.gpus_per_node} ranks "
                    f"(tp={group.tp} x dp={group.dp}) do not split {spec.name}'s "
                    f"{spec.experts} routed experts"
                )
            if group.gpus_per_node > self.hardware.gpus_per_node:
                raise ValueError(
                    f"cluster.{role}: tp={group.tp} x dp={group.dp} needs "
                    f"{group.gpus_per_node} GPUs per node, hardware has "
                    f"{self.hardware.gpus_per_node}"
                )
        return self

    @model_validator(mode="after")
    def _prefill_graphs(self) -> Experiment:
        """hw.latency.prefill_graphs fits GQA models on one rank a node, their experts (if
        any) grouped (disagg.hw.pieces)."""
        sizes, spec = self.hw.latency.prefill_graphs, self.model.spec
        if not sizes:
            return self
        why = [f"{spec.name} is MLA"] if spec.attention == "mla" else []
        why += ["hw.moe is reference"] if spec.is_moe and self.hw.moe != "grouped" else []
        why += [
            f"cluster.{role} has tp={g.tp} x dp={g.dp}"
            for role, g in self.cluster.groups.items()
            if g.gpus_per_node > 1
        ]
        if why:
            raise ValueError(
                f"hw.latency.prefill_graphs={list(sizes)}: for GQA models on one rank a node, "
                f"their experts grouped, but {'; '.join(why)}"
            )
        return self

    @model_validator(mode="after")
    def _faults(self) -> Experiment:
        faults.check(self.faults, {role: g.nodes for role, g in self.cluster.groups.items()})
        return self

    @model_validator(mode="after")
    def _context(self) -> Experiment:
        """A synthetic workload's longest prompt and longest output fit the model's context
        together (lengths without an upper bound, and traces: `check_context` checks each
        request)."""
        w = self.workload
        if w.trace is not None or w.prompt_tokens is None or w.output_tokens is None:
            return self
        prompt, output = _bound("prompt", w.prompt_tokens), _bound("output", w.output_tokens)
        if prompt is not None and output is not None:
            try:
                self.model.spec.check_context(prompt[1] + output[1], f"{prompt[0]} + {output[0]}")
            except ConfigError as e:
                raise ValueError(f"{e} (model.name={self.model.name!r})") from None
        return self


def _bound(kind: str, dist: LengthDist) -> tuple[str, int] | None:
    """("workload.KIND_tokens.FIELD=N", N) for the field bounding what `dist` draws; None if
    nothing does (a lognormal without `high`)."""
    field = "value" if dist.dist == "fixed" else "high"
    n = getattr(dist, field)
    return None if n is None else (f"workload.{kind}_tokens.{field}={n}", n)


def check_context(exp: Experiment, arrivals: Sequence[Arrival]) -> None:
    """Raise ConfigError naming the first of `arrivals` (the requests of `exp`'s workload) whose
    prompt + output exceed the model's context. Experiment validation bounds synthetic lengths
    already; this catches a trace's requests and lengths drawn without an upper bound."""
    spec, w = exp.model.spec, exp.workload
    if spec.max_context is None:
        return
    source = f"workload.trace={w.trace!r}" if w.trace is not None else "workload"
    refuse_too_long(arrivals, spec.max_context, spec.name, source)


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `data["a"]["b"] = value` for `dotted` = "a.b", creating tables as needed."""
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is a value, not a table")
        node = child
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`key.path=value` -> (key.path, value); the value is read as JSON/TOML if it can be."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
    return key.strip(), value


def build_experiment(
    data: dict[str, Any], overrides: list[str] | None = None, source: str = "<built-in>"
) -> Experiment:
    """Validate a parsed experiment table, then apply the environment's overrides (the
    `DISAGG_*` variables of disagg.settings) and `overrides`, in that order, each to the
    complete result (so an override changes one value and keeps every other, defaults
    included)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    data.setdefault("workload", DEFAULT_WORKLOAD.model_dump(exclude_none=True))
    exp = _validate(data, source)
    env = environment_overrides()
    if env:
        exp = _override(exp, list(env.values()), f"{source} with environment {' '.join(env)}")
    if overrides:
        exp = _override(exp, overrides, f"{source} with --set {' '.join(overrides)}")
    return exp


def _override(exp: Experiment, overrides: list[str], source: str) -> Experiment:
    full = exp.model_dump(mode="json", exclude_none=True)
    for text in overrides:
        set_path(full, *parse_override(text))
    return _validate(full, source)


def _validate(data: dict[str, Any], source: str) -> Experiment:
    try:
        return Experiment.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e, source)) from None


def _explain(e: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid experiment"]
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if err["type"] != "missing" and _short(err) else ""
        lines.append(f"  {where}: {msg}{got}")
    return "\n".join(lines)


def _short(err: Any) -> bool:
    return not isinstance(err.get("input"), dict) and len(repr(err.get("input"))) < 80


def _drop_unused_groups(record: dict[str, Any]) -> None:
    """Drop the cluster groups a run's record (its experiment.json, which lists every group)
    did not run: they say nothing, and explicit unused groups are an error."""
    cluster = record.get("cluster")
    if isinstance(cluster, dict):
        used = {"colocated"} if cluster.get("mode") == "colocated" else {"prefill", "decode"}
        for name in {"colocated", "prefill", "decode"} - used:
            cluster.pop(name, None)


def load_experiment(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> Experiment:
    """Read an experiment: a TOML file, the experiment.json of a run, or a run directory (the
    experiment it ran, so a hardware run can be simulated as it ran, or the reverse); the
    built-in default when `path` is None."""
    if path is None:
        return build_experiment({}, overrides)
    p = Path(path)
    if p.is_dir():
        if not (p / "experiment.json").exists():
            raise ConfigError(f"{p} is a directory without an experiment.json: not a run")
        p = p / "experiment.json"
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"experiment file {p} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON: {e}") from None
    data.setdefault("base_dir", str(p.parent.resolve()))
    if p.suffix == ".json":
        _drop_unused_groups(data)
    return build_experiment(data, overrides, str(p))
