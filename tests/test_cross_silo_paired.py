"""benchmarks/cross_silo_paired.py: per-silo paired differences between the cross-silo runs, on run directories the
test writes (a known difference per silo and seed gives a known mean, SEM and verdict)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _path in (str(_ROOT), str(_ROOT / "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import cross_silo_mnist  # noqa: E402
import cross_silo_paired as paired  # noqa: E402
import pytest  # noqa: E402

from privfl.errors import ConfigError  # noqa: E402

#: Each row's accuracy on silo i for seed s: a base per silo plus a row offset that differs by seed.
OFFSETS = {"Local": {0: 0.0, 1: 0.0}, "FedAvg": {0: -10.0, 1: -14.0}, "MR-MTL (lambda 0.001)": {0: 2.0, 1: 3.0}}


def _write_runs(out: Path, rounds: int, silos: int = 4) -> None:
    args = type("Args", (), {"out": str(out), "rounds": rounds})()
    for row, offsets in OFFSETS.items():
        method, settings = cross_silo_mnist.ROWS[row][1]
        for seed, offset in offsets.items():
            folder = cross_silo_mnist.run_dir(args, method, settings, "eps1", seed)
            folder.mkdir(parents=True)
            lines = ["client_id,role,accuracy"]
            # silo 0 of MR-MTL on seed 0 is 4 points lower than the others: the per-seed SEM over silos is not 0
            low = {("MR-MTL (lambda 0.001)", 0, 0): 4.0}
            lines += [f"{i},training,{50 + i + offset - low.get((row, seed, i), 0.0)}" for i in range(silos)]
            lines.append(f"{silos},novel,99.0")   # novel rows are not silos
            (folder / "clients.csv").write_text("\n".join(lines) + "\n")


def test_paired_differences_means_sems_and_verdicts_are_exact(tmp_path):
    _write_runs(tmp_path / "runs", rounds=7)
    results = tmp_path / "paired.json"
    paired.main(["--rounds", "7", "--seeds", "0,1", "--out", str(tmp_path / "runs"), "--results", str(results)])
    stored = json.loads(results.read_text())["eps1|rounds7|seeds0,1"]
    pairs = {(p["first"], p["second"]): p for p in stored["pairs"]}
    mrmtl_local = pairs[("MR-MTL (lambda 0.001)", "Local")]
    # seed 0: differences -2, 2, 2, 2 -> mean 1.0, SEM sqrt((9 + 1 + 1 + 1) / 3 / 4) = 1.0; seed 1: 3 on every silo
    assert [s["difference"] for s in mrmtl_local["per_seed"]] == pytest.approx([1.0, 3.0])
    assert mrmtl_local["per_seed"][0]["sem_over_silos"] == pytest.approx(1.0)
    assert mrmtl_local["per_seed"][1]["sem_over_silos"] == pytest.approx(0.0)
    assert [s["silos_above"] for s in mrmtl_local["per_seed"]] == [3, 4]
    assert mrmtl_local["mean_difference"] == pytest.approx(2.0)
    assert mrmtl_local["sem_over_seeds"] == pytest.approx(1.0)
    assert mrmtl_local["t95_half_width"] == pytest.approx(12.706)
    assert mrmtl_local["verdict"] == "interval includes 0"
    fedavg_local = pairs[("FedAvg", "Local")]
    assert fedavg_local["mean_difference"] == pytest.approx(-12.0)
    assert fedavg_local["t95_half_width"] == pytest.approx(2 * 12.706)
    assert fedavg_local["verdict"] == "interval includes 0"
    assert pairs[("MR-MTL (lambda 0.001)", "FedAvg")]["mean_difference"] == pytest.approx(14.0)
    assert stored["numerics"]["torch"]


def test_one_seed_has_no_interval_and_a_missing_run_names_the_command(tmp_path):
    _write_runs(tmp_path / "runs", rounds=7)
    paired.main(["--rounds", "7", "--seeds", "1", "--out", str(tmp_path / "runs"),
                 "--results", str(tmp_path / "p.json")])
    entry = json.loads((tmp_path / "p.json").read_text())["eps1|rounds7|seeds1"]
    assert all(p["verdict"] == "one seed: no interval" and p["t95_half_width"] == "nan" for p in entry["pairs"])
    with pytest.raises(ConfigError, match="cross_silo_mnist.py --rounds 8 --seeds 0 --levels eps1"):
        paired.main(["--rounds", "8", "--seeds", "0", "--out", str(tmp_path / "runs"),
                     "--results", str(tmp_path / "p.json")])
