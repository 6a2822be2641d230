"""What `disagg validate` runs: the profile grid an experiment's workload reaches, the loads
(from the capacity a profile implies), and the runs (each experiment at each load). No torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from disagg.config import Experiment, build_experiment
from disagg.core.policies import DEFAULT_SCHEDULERS, SCHEDULERS, SchedulerPolicy, scheduler_for
from disagg.core.workload import Arrival, generate
from disagg.errors import ConfigError
from disagg.settings import pieces_size

DEFAULT_LOADS = (0.25, 0.5, 0.85)  # fractions of the colocated capacity the profile implies
MOE_EVERY_BATCH = 32  # an MoE model's decode passes are profiled at every batch up to this


@dataclass(frozen=True)
class Run:
    label: str  # the run's name in the report and its directory
    exp: Experiment


def log_grid(low: int, high: int, points: int) -> tuple[int, ...]:
    """`points` log-spaced whole numbers from `low` to `high` (both kept), without repeats."""
    if high <= low:
        return (low,)
    if points < 2:
        return (high,)
    values = np.rint(np.geomspace(low, high, points)).astype(int)
    return tuple(sorted({int(v) for v in values} | {low, high}))


def other_mode(exp: Experiment) -> Experiment:
    """`exp` in the other cluster mode, on the same budgets: colocated gets the prefill group's
    token budget and the decode group's batch limit, and the reverse."""
    data = exp.model_dump(mode="json")
    c = exp.cluster
    if c.mode == "colocated":
        g = {"nodes": 1, "tp": 1, "dp": 1}
        groups = {
            "prefill": g | {"token_budget": c.colocated.token_budget},
            "decode": g | {"max_batch": c.colocated.max_batch},
        }
        mode = "disagg"
    else:
        one = {"nodes": 1, "tp": 1, "dp": 1, "token_budget": c.prefill.token_budget}
        groups, mode = {"colocated": one | {"max_batch": c.decode.max_batch}}, "colocated"
    data["cluster"] = {"mode": mode, "router": data["cluster"]["router"], **groups}
    data["name"] = f"{exp.name}-{mode}"
    return build_experiment(data, source=f"{exp.name} in cluster.mode={mode!r}")


def with_schedulers(exps: Sequence[Experiment], texts: Sequence[str]) -> list[Experiment]:
    """`exps`, then the first colocated one of them (else the first's other mode) once more for
    each colocated scheduler policy in `texts` (`parse_scheduler`), named EXPERIMENT-POLICY
    (`policy_label`). ConfigError naming a policy that is unknown, schedules no colocated
    node, has a bad setting, or runs already."""
    base = next((e for e in exps if e.cluster.mode == "colocated"), None) or other_mode(exps[0])
    out = list(exps)
    for text in texts:
        policy = parse_scheduler(text)
        spec = json.dumps(policy.model_dump(mode="json"))
        name = f"name={base.name}-{policy_label(policy)}"
        variant = base.updated(f"cluster.colocated.scheduler={spec}", name)
        if run_kind(variant) in map(run_kind, out):
            raise ConfigError(f"--schedulers {text!r}: a colocated run has that policy already")
        out.append(variant)
    return out


def parse_scheduler(text: str) -> SchedulerPolicy:
    """A colocated scheduler policy from its name and its settings, each as :KEY=VALUE
    ("decode_priority:chunk_with_decodes=512"). ConfigError naming `text` and what is wrong."""
    name, *pairs = text.split(":")
    settings: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not (key and eq) or key in (*settings, "name"):
            raise ConfigError(
                f"--schedulers {text!r}: {pair!r}: give each setting once, as :KEY=VALUE"
            )
        settings[key] = value
    try:
        return scheduler_for("colocated", SCHEDULERS.parse({**settings, "name": name}))
    except ConfigError as e:
        raise ConfigError(f"--schedulers {text!r}: {e}") from None


def policy_label(policy: SchedulerPolicy) -> str:
    """A policy's name, then each setting it has away from its default as .KEY=VALUE
    ("decode_priority.chunk_with_decodes=512")."""
    defaults = type(policy).model_fields
    changed = [
        f".{key}={value}"
        for key, value in policy.model_dump(mode="json").items()
        if key != "name" and value != defaults[key].default
    ]
    return policy.name + "".join(changed)


def run_kind(exp: Experiment) -> str:
    """What a run's label calls its experiment: its cluster mode, and the scheduler of a
    colocated one that runs another than the default ("colocated-prefill_first"), with its
    settings away from their defaults (`policy_label`)."""
    if exp.cluster.mode != "colocated":
        return exp.cluster.mode
    label = policy_label(_scheduler(exp, "prefill"))
    return "colocated" if label == DEFAULT_SCHEDULERS["colocated"] else f"colocated-{label}"


def _arrivals(exp: Experiment) -> list[Arrival]:
    return generate(exp.workload, exp.seed, Path(exp.base_dir))


def _group(exp: Experiment, kind: str) -> Any:
    groups = exp.cluster.groups
    return groups.get("colocated") or groups[kind]


def _scheduler(exp: Experiment, kind: str) -> SchedulerPolicy:
    """The scheduler policy of `exp`'s nodes that run `kind` passes (its colocated ones)."""
    role = "colocated" if "colocated" in exp.cluster.groups else kind
    return scheduler_for(role, _group(exp, kind).scheduler)


@dataclass(frozen=True)
class Grid:
    """The shapes `disagg.hw.profile.profile` measures (its arguments of the same names)."""

    prefill_tokens: tuple[int, ...]
    prefill_context: tuple[int, ...]
    decode_batch: tuple[int, ...]
    decode_context: tuple[int, ...]
    mixed: tuple[tuple[int, int, int], ...] = ()  # (chunk tokens, decodes, their context)
    decode_mix: tuple[int, ...] = ()  # contexts a decode batch's sequences are drawn from

    def __str__(self) -> str:
        def join(v: tuple[int, ...]) -> str:
            return ",".join(map(str, v))

        return (
            f"prefill {join(self.prefill_tokens)} tokens x {join(self.prefill_context)} cached; "
            f"decode batch {join(self.decode_batch)} x {join(self.decode_context)} context"
            + (f" and a mix of {min(m)}-{max(m)}; " if (m := self.decode_mix) else "; ")
            + f"{len(self.mixed)} mixed"
        )


def profile_grid(exps: Sequence[Experiment], points: int) -> Grid:
    """The profile grid the experiments' workloads reach: prefill chunks of the shortest prompt
    to the largest token budget (or longest prompt; a scheduler of whole prompts passes the
    budget with its longest), after 0 cached tokens or as many as a last chunk of the longest
    prompt has (in chunks of the budget, and of a policy's shorter chunks beside decodes);
    decode batches of 1 to the batch limit (or the number of requests), each at the shortest
    prompt's context and at a mix of the contexts the workload's requests pass through while
    they decode (`decode_mix`: each prompt plus 0, 1/4, 1/2 and 3/4 of its output; the profile
    also draws from its longest quarter); mixed passes of each chunk beside each decode batch,
    at the shortest context and at the mix.
    The mix, not one long context, gives each batch's line its slope: a server's batches mix
    long and short sequences, which take longer than uniform ones of the same total
    (docs/calibration.md, "Not the graphs: the mix of contexts").

    Decode passes are profiled at every power of two up to the batch limit as well: the hw
    runner replays a decode pass in the CUDA graph of the next power of two (GRAPH_BATCHES),
    so its fixed part steps up past each; and an MoE pass's time follows the experts its batch
    activates, which grows fast and then saturates (Qwen3-30B-A3B's passes of 2-25 sequences
    ran up to 16% longer than interpolated between batches 1, 6 and 40). An MoE model's are
    profiled at every batch up to MOE_EVERY_BATCH too: a graph's padding rows pick experts of
    their own, so a pass of 14 sequences in the graph of 16 costs neither the full graph's
    time nor a line's between its ends. Mixed passes, which run eagerly, keep the `points`
    batches; an MoE model's also every power of two between the second and the last. Beside a
    chunk whose tokens already activate the experts, its decodes' cost follows their own
    decode time only roughly: with mixed passes at 1, 11 and 120 decodes alone, Qwen3-30B-A3B's
    passes beside 20-60 cost 2-7% over what they ran (2026-12-07c).

    A pass packs prompts up to the token budget, so where the longest prompt is shorter the
    budget is a chunk of the grid too. With hw.latency.prefill_graphs, each piece up to the
    one that holds the budget is a chunk of the grid too: a pass replays the piece of the next
    size up, padded to it, so the profile reads each piece at its own size
    (disagg.sim.costmodel.padded_chunk). Qwen3-30B-A3B's prefill server, prompts of up to
    3,072 tokens in a budget of 4,096, ran a quarter of its passes at the top load in the
    4,096 piece (2026-12-06e)."""
    prompts, mix, chunks, whole, batches, cached = [], [], [], [0], [], {0}
    pieces = {n for exp in exps for n in exp.hw.latency.prefill_graphs}
    for exp in exps:
        arrivals = _arrivals(exp)
        prompts += [a.prompt_tokens for a in arrivals]
        mix += [a.prompt_tokens + a.output_tokens * q // 4 for a in arrivals for q in range(4)]
        batches.append(min(_group(exp, "decode").max_batch, len(arrivals)))
        policy = _scheduler(exp, "prefill")
        if policy.whole_prompts:  # each prompt in one pass, nothing cached
            whole += [a.prompt_tokens for a in arrivals]
            continue
        budget = _group(exp, "prefill").token_budget
        chunks.append(budget)
        # a prompt's last chunk comes after its whole chunks before it: of the budget, or of
        # the shorter chunks its policy runs beside decodes
        for n in {budget, policy.chunk_tokens(budget)}:
            cached.add(max(n * ((a.prompt_tokens - 1) // n) for a in arrivals))
    top = min(max(chunks, default=max(prompts)), max(prompts))
    prefill_tokens = log_grid(min(min(prompts), top), top, points)
    # a pass packs prompts up to the token budget, past the longest prompt: the budget is a
    # chunk too, and each piece up to the one that holds it
    budget = max(chunks, default=top)
    holds = pieces_size(sorted(pieces), budget) or budget
    sizes = sorted({*prefill_tokens, budget, *(n for n in pieces if n <= holds)})
    decode_batch = log_grid(1, max(batches), points)
    twos = {2**k for k in range(max(batches).bit_length())}
    powers, mixed_batches = set(twos), set(decode_batch)
    if exps[0].model.spec.is_moe:
        powers |= set(range(1, min(max(batches), MOE_EVERY_BATCH) + 1))
        mixed_batches |= {b for b in twos if b > decode_batch[min(1, len(decode_batch) - 1)]}
    return Grid(
        # whole prompts past every budget run in passes of their own, up to the longest
        prefill_tokens=(*sizes, *log_grid(top, max(top, *whole), points)[1:]),
        prefill_context=tuple(sorted(cached)),
        decode_batch=tuple(sorted({*decode_batch, *powers})),
        decode_context=(min(prompts),),
        # a colocated pass: a chunk beside a decode batch (the cost model's shared fixed cost)
        mixed=tuple(
            (n, b, min(prompts)) for n in sorted({*prefill_tokens}) for b in sorted(mixed_batches)
        ),
        decode_mix=tuple(sorted(mix)),
    )


def request_seconds(exp: Experiment, profile_csv: Path) -> tuple[float, float]:
    """One mean request of `exp`'s workload by the profile: its prefill chunks' time alone, and
    its share of decode passes at the full batch (its output tokens' passes over the batch)."""
    from disagg.core.scheduler import chunk_attn_pairs
    from disagg.sim.costmodel import ProfileCost, StepShape

    cost = ProfileCost(profile_csv, pieces=exp.hw.latency.prefill_graphs)
    arrivals = _arrivals(exp)
    prompt = float(np.mean([a.prompt_tokens for a in arrivals]))
    output = float(np.mean([a.output_tokens for a in arrivals]))
    budget = _group(exp, "prefill").token_budget
    prefill_s = 0.0
    for start in range(0, round(prompt), budget):
        n = min(budget, round(prompt) - start)
        shape = StepShape(prefill_tokens=n, prefill_attn_pairs=chunk_attn_pairs(start, n))
        prefill_s += cost.step_time(shape)
    batch = min(_group(exp, "decode").max_batch, len(arrivals))
    context = batch * (prompt + output / 2)
    decode_s = cost.step_time(StepShape(decode_seqs=batch, decode_context=context))
    return prefill_s, output * decode_s / batch


def capacity_per_s(exp: Experiment, profile_csv: Path) -> float:
    """Requests/s one colocated server of `exp` keeps up with by the profile, roughly: each
    request's prefill chunks, plus its share of decode passes at the full batch
    (`request_seconds`)."""
    return 1 / sum(request_seconds(exp, profile_csv))


def plan_runs(exps: Sequence[Experiment], rates: Sequence[float]) -> list[Run]:
    """Every experiment at every rate, labelled KIND-RATErps (`run_kind`; by name where kinds
    repeat)."""
    kinds = [run_kind(e) for e in exps]
    by_kind = len(set(kinds)) == len(kinds)
    runs = [
        Run(f"{kind if by_kind else e.name}-{r:g}rps", e.updated(f"workload.rate_per_s={r}"))
        for e, kind in zip(exps, kinds, strict=True)
        for r in rates
    ]
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"experiments share a name: runs {labels} would collide; rename them")
    return runs
