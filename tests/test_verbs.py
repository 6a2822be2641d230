"""The verbs wire, host side: what needs no RDMA device, and the soft-RoCE VM tier. Its NIC
choice and its connection rendezvous have their own tests (test_nics.py, test_rendezvous.py).

The VM tier (marked `rdma`) builds or reuses the image of tools/rdma-vm/, boots it once under
qemu TCG and runs tests/rdma inside, where rxe0 is a real verbs device: the wire's own tests and
a disaggregated prefill/decode run over it (two server processes on rxe0), checked against a
colocated run. Inside, Python imports from this repo's .venv (Debian's python3 has the same ABI).
It skips, with the reason, where qemu or the image cannot be had, or when DISAGG_SKIP_RDMA_VM=1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from disagg.errors import TransportError
from disagg.hw.transport.verbs import VerbsTransport, buffer_address, wc_status_name

REPO = Path(__file__).resolve().parents[1]
VM = REPO / "tools" / "rdma-vm"
DEBIAN_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")
# tests in tests/rdma, all of which must pass inside the VM: 16 of the wire itself
# (test_verbs_rxe.py) and 4 disaggregated runs over it (test_disagg_verbs.py: 2 of TP1 nodes,
# 2 of a TP2 node's pages on one side)
VM_TESTS = 20


def test_import_needs_no_pyverbs_and_use_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # as if pyverbs were not installed
    with pytest.raises(TransportError, match=r"the verbs wire needs pyverbs.*python3-pyverbs"):
        VerbsTransport()


@pytest.mark.skipif(not DEBIAN_PYVERBS.is_dir(), reason="needs Debian's python3-pyverbs")
@pytest.mark.skipif(
    Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir()),
    reason="this host has an RDMA device",
)
def test_no_device_gives_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "pyverbs").symlink_to(DEBIAN_PYVERBS)  # the system's pyverbs, nothing else
    code = (
        "from disagg.hw.transport.verbs import VerbsTransport\n"
        "try:\n    VerbsTransport()\nexcept Exception as ex:\n"
        "    print(type(ex).__name__, ex)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.startswith("TransportError no RDMA device found"), out.stdout + out.stderr


def test_buffer_addresses_of_host_memory() -> None:
    arr = np.zeros((4, 16), dtype=np.float16)
    assert buffer_address(arr) == (arr.ctypes.data, 128, False)
    assert buffer_address(bytearray(10))[1:] == (10, False)
    with pytest.raises(TransportError, match="writable and contiguous"):
        buffer_address(b"immutable")
    with pytest.raises(TransportError, match="writable and contiguous"):
        buffer_address(arr[:, ::2])
    torch = pytest.importorskip("torch")
    t = torch.zeros(8, 4, dtype=torch.bfloat16)
    assert buffer_address(t) == (t.data_ptr(), 64, False)
    with pytest.raises(TransportError, match="contiguous"):
        buffer_address(t.t())


def test_status_names() -> None:
    assert wc_status_name(10) == "IBV_WC_REM_ACCESS_ERR"
    assert wc_status_name(12) == "IBV_WC_RETRY_EXC_ERR"
    assert wc_status_name(99) == "IBV_WC_status 99"


# --- the soft-RoCE VM tier ---------------------------------------------------------------------
def vm_unavailable() -> str | None:
    if os.environ.get("DISAGG_SKIP_RDMA_VM") == "1":
        return "DISAGG_SKIP_RDMA_VM=1"
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 not installed (tools/rdma-vm/install-host-deps.sh)"
    cached = list((VM / "cache").glob("*/initrd.img"))
    if not cached and (shutil.which("mmdebstrap") is None or os.geteuid() != 0):
        return "no cached VM image, and building one needs root and mmdebstrap"
    return None


@pytest.fixture(scope="session")
def vm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """Boot the VM once and run tests/rdma inside; (the run, its output folder)."""
    reason = vm_unavailable()
    if reason:
        pytest.skip(f"soft-RoCE VM tier skipped: {reason}")
    out = tmp_path_factory.mktemp("rdma-vm")
    start = time.monotonic()
    build = subprocess.run([str(VM / "build.sh")], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.fail(f"building the VM image failed:\n{build.stderr[-3000:]}")
    built = time.monotonic()
    cmd = [str(VM / "run.sh"), "python3", "-m", "pytest", "-c", "tests/rdma/pytest.ini",
           "tests/rdma", "-q", "-p", "no:cacheprovider", "--junitxml=/out/junit.xml"]  # fmt: skip
    env = {**os.environ, "RDMA_VM_OUT": str(out), "RDMA_VM_TIMEOUT": "900"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    print(f"VM image {built - start:.1f} s, boot + tests {time.monotonic() - built:.1f} s")
    print(run.stdout[-4000:], run.stderr[-2000:])
    return run, out


@pytest.mark.rdma
@pytest.mark.slow
def test_the_rdma_suite_passes_on_soft_roce(
    vm_run: tuple[subprocess.CompletedProcess, Path],
) -> None:
    run, out = vm_run
    report = out / "junit.xml"
    assert report.exists(), f"the VM wrote no report:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    # the two disaggregated runs need the venv's torch inside the VM (an install without the
    # hw extra skips their module there)
    import importlib.util

    torch = importlib.util.find_spec("torch") is not None  # else the module skips as one
    want = {
        "tests": VM_TESTS if torch else VM_TESTS - 1,
        "failures": 0,
        "errors": 0,
        "skipped": 0 if torch else 1,
    }
    assert counts == want, run.stdout[-6000:]
    assert run.returncode == 0
