"""NICs as fair-shared servers: bandwidth, latency, per-op cost, several NICs, floors."""

import pytest
import simpy

from disagg.hardware import NIC
from disagg.sim.network import Network

NIC1 = NIC("test", bandwidth_gbps=8, latency_s=0.001, op_cost_s=0.0001)  # 1 GB/s


def finish_times(starts: list[tuple[float, dict, float]]) -> list[float]:
    env = simpy.Environment()
    net = Network(env)
    for key in ("a", "b"):
        net.add_nic(key, NIC1)
    done: list[float] = [0.0] * len(starts)

    def flow(i: int, at: float, work: dict, floor: float):
        yield env.timeout(at)
        yield net.transfer(work, floor)
        done[i] = env.now

    for i, (at, work, floor) in enumerate(starts):
        env.process(flow(i, at, work, floor))
    env.run()
    return done


def test_work_is_bytes_over_bandwidth_plus_ops() -> None:
    env = simpy.Environment()
    net = Network(env)
    net.add_nic("a", NIC1)
    assert net.work_s("a", 1e9, 10) == pytest.approx(1.0 + 0.001)


def test_single_flow_takes_work_plus_latency() -> None:
    assert finish_times([(0, {"a": 1.0}, 0)]) == [pytest.approx(1.001)]


def test_two_flows_share_a_nic_fairly() -> None:
    # both active for 2 s at half rate: each needs 1 s of work
    t = finish_times([(0, {"a": 1.0}, 0), (0, {"a": 1.0}, 0)])
    assert t == [pytest.approx(2.001), pytest.approx(2.001)]


def test_late_flow_slows_an_early_one() -> None:
    # flow 0 runs alone 0.5 s (0.5 done), then shares: 0.5 left at half rate -> ends at 1.5;
    # flow 1 then has 0.5 left alone -> ends at 2.0
    t = finish_times([(0, {"a": 1.0}, 0), (0.5, {"a": 1.0}, 0)])
    assert t == [pytest.approx(1.501), pytest.approx(2.001)]


def test_flows_on_different_nics_do_not_interfere_and_wait_for_all_parts() -> None:
    t = finish_times([(0, {"a": 1.0, "b": 0.25}, 0), (0, {"b": 1.0}, 0)])
    assert t == [pytest.approx(1.001), pytest.approx(1.251)]


def test_not_before_floor() -> None:
    assert finish_times([(0, {"a": 0.1}, 5.0)]) == [pytest.approx(5.0)]


def test_utilisation() -> None:
    env = simpy.Environment()
    net = Network(env)
    net.add_nic("a", NIC1)

    def go():
        yield net.transfer({"a": 1.0})
        yield env.timeout(3.0)

    env.process(go())
    env.run()
    assert net.utilisation("a") == pytest.approx(1.0 / 4.001, rel=1e-3)
