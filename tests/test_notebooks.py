"""Every notebook executes top to bottom (its own asserts check the tables it reads)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any(o.get("output_type") == "execute_result" for o in outputs)


def test_hardware_vs_simulator_marks_a_fidelity_csv_against_its_tolerances(
    tmp_path: Path,
) -> None:
    """The notebook's first code cell names the fidelity.csv it reads: pointed at a hand-made
    one, it marks each ratio within its tolerance (TTFT 5%, TPOT 3%, throughput 3%)."""
    (tmp_path / "fidelity.csv").write_text(
        "run,metric,hw,sim_profile,sim_roofline\n"
        "a,ttft_s_p50,0.100,0.104,0.2\n"  # 1.04: within 5%; roofline 2
        "a,tpot_s_p50,0.010,0.01031,0.005\n"  # 1.031: beyond 3%
        "a,itl_s_p99,0.04,0.05,0.02\n"  # no tolerance: unmarked
        "a,output_throughput,1000,970,1000\n"  # 0.97: 3% off, within
    )
    path = NOTEBOOKS[0].parent / "hardware_vs_simulator.ipynb"
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    first.source += f"\nFIDELITY = Path({str(tmp_path)!r})"
    part2 = next(i for i, c in enumerate(nb.cells) if c.source.startswith("# Part 2"))
    nb.cells = nb.cells[:part2]  # the fidelity part alone
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    text = "\n".join(
        "".join(o["data"]["text/plain"])
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if "text/plain" in o.get("data", {})
    )
    for shown in ("1.04 ✓", "2 ✗", "1.03 ✗", "0.5 ✗", "0.97 ✓", "1 ✓", "1.25", "0.5"):
        assert shown in text, shown
    assert "1.25 ✓" not in text and "1.25 ✗" not in text
    # by metric: profile TTFT and throughput met, TPOT not; roofline throughput alone
    assert text.count("1 of 1") == 3 and text.count("0 of 1") == 3
