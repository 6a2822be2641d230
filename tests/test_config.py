"""Experiment files: defaults, overrides, and clear errors for bad input."""

import json
from pathlib import Path

import pytest

from disagg.config import Experiment, load_experiment, parse_override
from disagg.core.policies import ChunkedConfig, FcfsConfig, LeastLoadedConfig, RoundRobinConfig
from disagg.errors import ConfigError

EXPERIMENTS = Path(__file__).parent.parent / "experiments"


def test_default_experiment_is_r1_one_prefill_three_decode() -> None:
    exp = load_experiment()
    assert exp == Experiment()
    assert exp.model.name == "deepseek-r1" and exp.cluster.mode == "disagg"
    assert (exp.cluster.prefill.nodes, exp.cluster.decode.nodes) == (1, 3)
    assert exp.cluster.total_gpus == 32


def test_default_cluster_is_unchanged_but_for_the_typed_router_and_gpus_of_its_own() -> None:
    group = {"tp": 8, "dp": 1, "expert_parallel": False, "max_batch": 256}
    group |= {"token_budget": 8192, "scheduler": None}
    assert Experiment().cluster.model_dump() == {
        "mode": "disagg",
        "colocated": {"nodes": 4, **group},
        "prefill": {"nodes": 1, **group},
        "decode": {"nodes": 3, **group},
        "router": {"name": "least_loaded"},
        "shared_gpu": False,
        "decode_share": 0.5,
        "prefill_share": None,
        "chunk_extra_s": 0.0,
        "chunk_extra_shape": (),
        "chunk_extra_wide": 1.0,
        "decode_share_shape": (),
        "decode_share_wide": 1.0,
        "switch_s": None,
        "turn_slice_s": None,
    }
    assert Experiment().cluster.router == LeastLoadedConfig()


def test_policies_are_chosen_by_name_in_the_file(tmp_path: Path) -> None:
    f = tmp_path / "e.toml"
    f.write_text(
        '[cluster]\nmode = "colocated"\n'
        '[cluster.colocated.scheduler]\nname = "chunked"\n'
        '[cluster.router]\nname = "round_robin"\n'
    )
    c = load_experiment(f).cluster
    assert c.colocated.scheduler == ChunkedConfig() and c.router == RoundRobinConfig()
    f.write_text('[cluster.decode]\nscheduler = "fcfs"\n')  # a name alone: a table of defaults
    c = load_experiment(f).cluster
    assert c.decode.scheduler == FcfsConfig() and c.prefill.scheduler is None


def test_router_names_as_plain_strings_still_load(tmp_path: Path) -> None:
    f = tmp_path / "e.toml"
    f.write_text('[cluster]\nrouter = "round_robin"\n')
    assert load_experiment(f).cluster.router == RoundRobinConfig()
    exp = load_experiment(EXPERIMENTS / "r1-disagg-1p3d.toml", ["cluster.router=round_robin"])
    assert exp.cluster.router == RoundRobinConfig()
    run = tmp_path / "run"  # a run's experiment.json, written as the CLI does, reads back
    run.mkdir()
    (run / "experiment.json").write_text(exp.model_dump_json(indent=2))
    assert load_experiment(run).cluster == exp.cluster


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_experiments_load(path: Path) -> None:
    exp = load_experiment(path)
    assert exp.name == path.stem
    # colocated and disaggregated get the same GPUs (not the tiny tests, not the cluster-scale
    # benchmark, not the one-H200 hardware runs, whose nodes all share that GPU)
    if not exp.name.startswith(("tiny", "cluster-")) and "-h200" not in exp.name:
        assert exp.cluster.total_gpus == 32


def test_override_changes_one_value_and_keeps_the_rest() -> None:
    exp = load_experiment(EXPERIMENTS / "r1-colocated.toml", ["cluster.colocated.max_batch=64"])
    assert exp.cluster.colocated.max_batch == 64
    assert exp.cluster.colocated.nodes == 4 and exp.cluster.colocated.token_budget == 8192


def test_parse_override_values() -> None:
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a=1.5") == ("a", 1.5)
    assert parse_override("a=NHD") == ("a", "NHD")
    assert parse_override("a=true") == ("a", True)
    with pytest.raises(ConfigError, match=r"expected key\.path=value"):
        parse_override("rate")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("workload.rate_per_s=-1", "workload.rate_per_s: Input should be greater than 0"),
        ("model.name=gpt-9", "unknown model 'gpt-9'"),
        ("hardware.gpu=B300", "unknown GPU 'B300'"),
        ("cluster.decode.tp=3", "cluster.decode: tp=3 does not divide deepseek-r1's 128"),
        ("cluster.prefill.tp=16", "needs 16 GPUs per node, hardware has 8"),
        ("spec.accepted_tokens_per_step=3", "cannot exceed draft_tokens + 1 = 1"),
        ("kv.layout=HDN", "kv.layout: Input should be 'HND' or 'NHD'"),
        ("cost.source=magic", "use 'roofline' or 'profile:PATH'"),
        ("cluster.nodes=4", "cluster.nodes: Extra inputs are not permitted"),
        (
            "cluster.prefill.scheduler.name=chunked",
            "cluster.prefill.scheduler.name: 'chunked' schedules colocated nodes, not prefill; "
            "prefill policies: fifo",
        ),
        (
            "cluster.colocated.scheduler=fcfs",
            "cluster.colocated.scheduler.name: 'fcfs' schedules decode nodes, not colocated; "
            "colocated policies: chunked",
        ),
        (
            "cluster.decode.scheduler.name=lifo",
            "cluster.decode.scheduler: unknown scheduler policy 'lifo'; known: fifo, fcfs, chunked",
        ),
        (
            "cluster.router=random",
            "cluster.router: unknown router 'random'; known: round_robin, least_loaded",
        ),
        (
            "cluster.router.seed=3",
            "cluster.router: router 'least_loaded': seed: Extra inputs are not permitted",
        ),
        (
            "cluster.chunk_extra_shape=[[0.02,1],[0.01,0.5]]",
            "cluster.chunk_extra_shape: [[0.02, 1.0], [0.01, 0.5]]: give (seconds, factor) points",
        ),
        (
            "cluster.chunk_extra_shape=[[0.01,-1]]",
            "cluster.chunk_extra_shape: [[0.01, -1.0]]: give (seconds, factor) points",
        ),
        (
            "cluster.chunk_extra_shape=[[-0.5,1]]",
            "cluster.chunk_extra_shape: [[-0.5, 1.0]]: give (seconds, factor) points",
        ),
    ],
)
def test_bad_values_name_the_field_and_value(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match="invalid experiment") as err:
        load_experiment(None, [override])
    assert message in str(err.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_experiment(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_experiment(bad)
    with pytest.raises(ConfigError, match=r"without an experiment\.json: not a run"):
        load_experiment(tmp_path)
    (tmp_path / "experiment.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"experiment\.json: not valid JSON"):
        load_experiment(tmp_path)


def test_trace_workload_and_malformed_trace(tmp_path: Path) -> None:
    from disagg.core.workload import generate
    from disagg.errors import TraceError

    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 100, "output_length": 5}\n'
        '{"timestamp": 250, "input_length": "x", "output_length": 5}\n'
    )
    f = tmp_path / "e.toml"
    f.write_text('[workload]\ntrace = "t.jsonl"\n')
    exp = load_experiment(f)
    with pytest.raises(TraceError, match=r"t.jsonl:2: input_length"):
        generate(exp.workload, exp.seed, Path(exp.base_dir))


@pytest.mark.parametrize(
    ("text", "named", "mode"),
    [
        ('mode = "colocated"\nprefill = { nodes = 2 }\n', "cluster.prefill", "'colocated'"),
        (
            'mode = "colocated"\nprefill = { tp = 4 }\ndecode = { nodes = 5 }\n',
            "cluster.prefill and cluster.decode",
            "'colocated'",
        ),
        ('mode = "disagg"\ncolocated = { nodes = 2 }\n', "cluster.colocated", "'disagg'"),
        ("colocated = { max_batch = 16 }\n", "cluster.colocated", "'disagg'"),  # mode by default
    ],
)
def test_a_group_the_mode_does_not_run_is_an_error_naming_it(
    tmp_path: Path, text: str, named: str, mode: str
) -> None:
    f = tmp_path / "e.toml"
    f.write_text(f"[cluster]\n{text}")
    with pytest.raises(ConfigError) as err:
        load_experiment(f)
    assert f"cluster: {named} set, but cluster.mode={mode} runs only" in str(err.value)
    assert f"remove {named} from the experiment" in str(err.value)


def test_unused_groups_at_their_defaults_and_complete_records_still_load(tmp_path: Path) -> None:
    """Defaults validate, a dump lists every group (the unused ones at their defaults) and
    reads back, and a run's record whose unused groups are not the defaults (written before
    they were an error) loads as the run ran."""
    assert Experiment.model_validate(Experiment().model_dump()) == Experiment()
    for path in sorted(EXPERIMENTS.glob("*.toml")):
        exp = load_experiment(path)
        assert Experiment.model_validate(exp.model_dump(mode="json")) == exp
    record = Experiment().model_dump(mode="json")
    record["cluster"]["mode"] = "colocated"
    record["cluster"]["prefill"]["nodes"] = 7  # not the default, not run
    (tmp_path / "experiment.json").write_text(json.dumps(record))
    exp = load_experiment(tmp_path)
    assert exp.cluster.mode == "colocated" and exp.cluster.prefill == Experiment().cluster.prefill
    assert exp.cluster.colocated == Experiment().cluster.colocated


def test_overrides_that_leave_a_group_unused_are_errors_naming_what_to_remove() -> None:
    # the default experiment's groups are all defaults: switching its mode is fine
    assert load_experiment(None, ["cluster.mode=colocated"]).cluster.total_gpus == 32
    with pytest.raises(ConfigError) as err:
        load_experiment(EXPERIMENTS / "r1-colocated.toml", ["cluster.prefill.nodes=2"])
    assert "cluster.prefill set, but cluster.mode='colocated' runs only cluster.colocated" in str(
        err.value
    )
    # r1-disagg-1p3d's prefill group is not the default one (its decode group is)
    with pytest.raises(ConfigError) as err:
        load_experiment(EXPERIMENTS / "r1-disagg-1p3d.toml", ["cluster.mode=colocated"])
    assert "remove cluster.prefill from the experiment (or the --set overrides)" in str(err.value)


def test_a_synthetic_workload_longer_than_the_context_names_the_fields() -> None:
    llama = ["model.name=llama-3.1-8b", "workload.prompt_tokens.high=131000"]
    with pytest.raises(ConfigError) as err:
        load_experiment(None, llama)
    assert (
        "workload.prompt_tokens.high=131000 + workload.output_tokens.high=1000 = 132,000 tokens "
        "exceed llama-3.1-8b's context of 131,072 tokens (model.name='llama-3.1-8b')"
    ) in str(err.value)
    fixed = ["workload.output_tokens={dist = 'fixed', value = 72}"]
    assert load_experiment(None, [*llama, *fixed]).workload.output_tokens is not None  # 131,072
    with pytest.raises(ConfigError, match=r"workload.output_tokens.value=73 = 131,073 tokens"):
        load_experiment(None, [*llama, "workload.output_tokens={dist = 'fixed', value = 73}"])
    # R1's context is longer: the same lengths fit
    assert load_experiment(None, ["workload.prompt_tokens.high=131000"]).model.name == "deepseek-r1"


def test_check_context_names_the_request_of_a_trace_or_of_unbounded_draws(tmp_path: Path) -> None:
    from disagg.config import check_context
    from disagg.core.workload import generate

    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 100, "output_length": 5}\n'
        '{"timestamp": 250, "input_length": 1000000, "output_length": 5}\n'
    )
    f = tmp_path / "e.toml"
    f.write_text('[model]\nname = "llama-3.1-8b"\n[workload]\ntrace = "t.jsonl"\n')
    exp = load_experiment(f)
    with pytest.raises(ConfigError) as err:
        check_context(exp, generate(exp.workload, exp.seed, Path(exp.base_dir)))
    assert str(err.value) == (
        "workload.trace='t.jsonl': request 1 (1 of 2 too long): 1,000,000 prompt + 5 output = "
        "1,000,005 tokens exceed llama-3.1-8b's context of 131,072 tokens"
    )
    unbounded = load_experiment(
        EXPERIMENTS / "tiny-disagg.toml",
        ["workload.prompt_tokens={dist = 'lognormal', mean = 30000, sigma = 0.5}"],
    )  # no high: validation cannot bound it (tiny-gqa's context is 32,768), the draws are checked
    with pytest.raises(ConfigError, match=r"^workload: request \d+ \(\d+ of \d+ too long\)"):
        check_context(unbounded, generate(unbounded.workload, unbounded.seed))
    check_context(Experiment(), generate(Experiment().workload, 0))  # fits: no error
