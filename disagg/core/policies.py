"""Scheduler and router policies, chosen by name from the experiment.

A policy is one frozen pydantic config class: a `name` tag, the policy's own settings, and a
`build` method that makes the policy object. Registering the class (`@SCHEDULERS.register`,
`@ROUTERS.register`) is all it takes for an experiment to choose it:

    [cluster.colocated.scheduler]       [cluster.router]
    name = "chunked"                    name = "round_robin"

`SchedulerConfig` and `RouterConfig` are the experiment's field types: a union of the registered
classes discriminated by `name`, resolved from the registry when a file is validated, so that
a policy registered at runtime (a test, a notebook) validates like a built-in one.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Generic, Literal, Protocol, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    SerializeAsAny,
    ValidationError,
)

from disagg.core.kvcache import PagePool
from disagg.core.router import LeastLoaded, RoundRobin, Router
from disagg.core.scheduler import (
    Batch,
    ColocatedScheduler,
    DecodePriorityScheduler,
    DecodeScheduler,
    PrefillFirstScheduler,
    PrefillScheduler,
    Progress,
)
from disagg.errors import ConfigError


class Policy(BaseModel):
    """Base of every policy config: frozen, no unknown keys, tagged by `name`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str


P = TypeVar("P", bound=Policy)


class Registry(Generic[P]):
    """Policy config classes by name (each class's `name` default)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.classes: dict[str, type[P]] = {}

    def register(self, cls: type[P]) -> type[P]:
        """Add `cls` (a class decorator); its name is the default of its `name` field."""
        name = cls.model_fields["name"].default
        if not isinstance(name, str):
            raise ConfigError(f"{cls.__name__}: a {self.kind} needs a default name")
        if name in self.classes:
            raise ConfigError(f"{self.kind} {name!r} is already registered")
        self.classes[name] = cls
        return cls

    def get(self, name: str) -> type[P]:
        if name not in self.classes:
            raise ConfigError(f"unknown {self.kind} {name!r}; known: {', '.join(self.classes)}")
        return self.classes[name]

    def parse(self, value: Any) -> P:
        """A config from a config, a name, or a table with a name (the fields' validator)."""
        if isinstance(value, Policy) and type(value) is self.classes.get(value.name):
            return value
        if isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
            raise ConfigError(
                f"a {self.kind} is a name or a table with a name; known: {', '.join(self.classes)}"
            )
        cls = self.get(value["name"])
        try:
            return cls.model_validate(value)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()
            )
            raise ConfigError(f"{self.kind} {value['name']!r}: {problems}") from None


# ---- schedulers ---------------------------------------------------------------------------


class Scheduler(Protocol):
    """What every batch policy does (roles.py asks each role's kind for more)."""

    def __len__(self) -> int: ...
    def schedule(self) -> Batch: ...
    def complete(self, batch: Batch) -> Progress: ...


class GroupLike(Protocol):
    """The settings of a node group (config.GroupConfig; core does not import config)."""

    @property
    def scheduler(self) -> SchedulerPolicy | None: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def token_budget(self) -> int: ...


@dataclass(frozen=True)
class SchedulerArgs:
    """What a scheduler is built from: its group's settings and its node's pool."""

    group: GroupLike
    pool: PagePool
    tokens_per_step: float = 1.0  # tokens a decode step emits on average (speculation: > 1)
    decode_qo: int = 1  # query tokens per decoding sequence in a pass (1 + draft tokens)


class SchedulerPolicy(Policy):
    """A batch policy's config. `roles`: the node roles it can schedule; `whole_prompts`: its
    passes carry whole prompts, one longer than the token budget alone in a pass."""

    roles: ClassVar[tuple[str, ...]] = ()
    whole_prompts: ClassVar[bool] = False

    @abstractmethod
    def build(self, args: SchedulerArgs) -> Scheduler:
        """The scheduler of one node."""

    def chunk_tokens(self, token_budget: int) -> int:
        """The longest prompt chunk a pass carries beside decodes, for a group of
        `token_budget` tokens a pass."""
        return token_budget


SCHEDULERS = Registry[SchedulerPolicy]("scheduler policy")


@SCHEDULERS.register
class FifoConfig(SchedulerPolicy):
    """Prefill nodes: chunked prefill in arrival order (PrefillScheduler)."""

    name: Literal["fifo"] = "fifo"
    roles = ("prefill",)

    def build(self, args: SchedulerArgs) -> Scheduler:
        return PrefillScheduler(args.group.token_budget, args.group.max_batch)


@SCHEDULERS.register
class FcfsConfig(SchedulerPolicy):
    """Decode nodes: requests join the batch in the order their KV arrived (DecodeScheduler)."""

    name: Literal["fcfs"] = "fcfs"
    roles = ("decode",)

    def build(self, args: SchedulerArgs) -> Scheduler:
        return DecodeScheduler(args.group.max_batch, args.tokens_per_step)


def colocated(
    cls: type[ColocatedScheduler], args: SchedulerArgs, **settings: int
) -> ColocatedScheduler:
    """A colocated scheduler of class `cls` for the node of `args`, with the policy's own
    `settings` as keywords."""
    g = args.group
    return cls(
        args.pool, g.token_budget, g.max_batch, args.tokens_per_step, args.decode_qo, **settings
    )


@SCHEDULERS.register
class ChunkedConfig(SchedulerPolicy):
    """Colocated nodes: running decodes first, prompt chunks fill the rest of the token
    budget (Sarathi-style; ColocatedScheduler)."""

    name: Literal["chunked"] = "chunked"
    roles = ("colocated",)

    def build(self, args: SchedulerArgs) -> Scheduler:
        return colocated(ColocatedScheduler, args)


@SCHEDULERS.register
class PrefillFirstConfig(SchedulerPolicy):
    """Colocated nodes: waiting prompts first, whole, in passes of their own; decodes run only
    in passes without prompts (vLLM's original scheduler; PrefillFirstScheduler)."""

    name: Literal["prefill_first"] = "prefill_first"
    roles = ("colocated",)
    whole_prompts = True

    def build(self, args: SchedulerArgs) -> Scheduler:
        return colocated(PrefillFirstScheduler, args)


@SCHEDULERS.register
class DecodePriorityConfig(SchedulerPolicy):
    """Colocated nodes: running decodes in every pass, prompts in chunks of at most
    `chunk_with_decodes` tokens while any decode runs (DecodePriorityScheduler)."""

    name: Literal["decode_priority"] = "decode_priority"
    roles = ("colocated",)
    chunk_with_decodes: int = Field(default=256, gt=0)

    def build(self, args: SchedulerArgs) -> Scheduler:
        return colocated(DecodePriorityScheduler, args, chunk_with_decodes=self.chunk_with_decodes)

    def chunk_tokens(self, token_budget: int) -> int:
        return min(token_budget, self.chunk_with_decodes)


DEFAULT_SCHEDULERS = {"prefill": "fifo", "decode": "fcfs", "colocated": "chunked"}  # by role


def scheduler_for(role: str, cfg: SchedulerPolicy | None) -> SchedulerPolicy:
    """The policy a `role` node runs: `cfg`, or the role's default for None. A policy of
    another role is a ConfigError naming the field `cluster.<role>.scheduler.name`."""
    if role not in DEFAULT_SCHEDULERS:
        raise ConfigError(f"unknown role {role!r}; known: {', '.join(DEFAULT_SCHEDULERS)}")
    if cfg is None:
        return SCHEDULERS.parse(DEFAULT_SCHEDULERS[role])
    if role not in cfg.roles:
        known = [n for n, c in SCHEDULERS.classes.items() if role in c.roles]
        its = " and ".join(cfg.roles) or "no"
        raise ConfigError(
            f"cluster.{role}.scheduler.name: {cfg.name!r} schedules {its} nodes, not {role}; "
            f"{role} policies: {', '.join(known)}"
        )
    return cfg


def make_scheduler(
    role: str,
    group: GroupLike,
    pool: PagePool,
    tokens_per_step: float = 1.0,
    decode_qo: int = 1,
) -> Scheduler:
    """The scheduler of one `role` node ("prefill", "decode" or "colocated") of `group`."""
    policy = scheduler_for(role, group.scheduler)
    return policy.build(SchedulerArgs(group, pool, tokens_per_step, decode_qo))


# ---- routers ------------------------------------------------------------------------------


class RouterPolicy(Policy):
    """A router's config."""

    @abstractmethod
    def build(self, nodes: list[int]) -> Router:
        """A router over `nodes` (at least one)."""


ROUTERS = Registry[RouterPolicy]("router")


@ROUTERS.register
class RoundRobinConfig(RouterPolicy):
    """Cycle through the nodes in order, ignoring load."""

    name: Literal["round_robin"] = "round_robin"

    def build(self, nodes: list[int]) -> Router:
        return RoundRobin(nodes)


@ROUTERS.register
class LeastLoadedConfig(RouterPolicy):
    """The least loaded node; ties go to the lowest node id."""

    name: Literal["least_loaded"] = "least_loaded"

    def build(self, nodes: list[int]) -> Router:
        return LeastLoaded(nodes)


def make_router(cfg: RouterConfig | str, nodes: Sequence[int]) -> Router:
    """A router of policy `cfg` (a config, or a policy name) over `nodes`."""
    policy = ROUTERS.parse(cfg)
    if not nodes:
        raise ConfigError("a router needs at least one node")
    return policy.build(list(nodes))


# ---- experiment field types ---------------------------------------------------------------

_INPUT = str | dict[str, Any]  # what a file may hold: a name, or a table with a name
SchedulerConfig = Annotated[
    SerializeAsAny[SchedulerPolicy],
    PlainValidator(SCHEDULERS.parse, json_schema_input_type=_INPUT),
]
RouterConfig = Annotated[
    SerializeAsAny[RouterPolicy],
    PlainValidator(ROUTERS.parse, json_schema_input_type=_INPUT),
]
