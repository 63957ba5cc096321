"""The main job's comparison with its stored figures (privfl.evaluation.reference) on small fake sweeps."""

from __future__ import annotations

import copy
import json

import pytest

from privfl.evaluation.reference import compare_cells, find_reference, reference_report, settings_differences

NUMERICS = {"torch": "2.14.1+cu130", "cpu_capability": "AVX512", "threads": 1, "code_revision": "abc1234"}


def sweep(accuracy: float = 90.0, sem: float = 1.0, **config) -> dict:
    """A sweep.json as privfl sweep writes it: two trainings, two novel levels and a control, sizes 50 and 500."""
    table = {level: {n: {"accuracy": accuracy, "sem": sem, "count": 5, "rows": 5} for n in ("50", "500")}
             for level in ("inf", "0.3", "control_other_mix")}
    trainings = {key: {"table": copy.deepcopy(table), "training": {"numerics": dict(NUMERICS)}}
                 for key in ("8", "inf")}
    return {"config": {"dataset": "mnist", "rounds": 200, "seed": 0, "private_rounds": 20, "sizes": [50, 500],
                       "epsilons": [0.3], "train_epsilons": ["8", "inf"], "device": "cpu", **config},
            "trainings": trainings, "numerics": dict(NUMERICS, code_revision="def5678")}


@pytest.fixture
def results(tmp_path):
    folder = tmp_path / "benchmarks" / "results"
    folder.mkdir(parents=True)
    (folder / "sweep_demo.json").write_text(json.dumps(sweep()))
    (folder / "other.json").write_text(json.dumps({"config": {}, "rows": []}))    # not a sweep: skipped
    return folder


def test_the_same_figures_reproduce_and_a_shift_beyond_two_sem_is_named_with_revision_and_numerics(results):
    assert reference_report(sweep(), folder=results).splitlines()[-1].startswith(
        "Reproduced within tolerance (12 cells compared; 12 within tolerance)")
    within = sweep()
    within["trainings"]["inf"]["table"]["inf"]["500"]["accuracy"] = 91.9     # 1.9 points: within 2 SEM of 1.0
    assert reference_report(within, folder=results).splitlines()[-1].startswith("Reproduced within tolerance")
    moved = copy.deepcopy(within)
    moved["trainings"]["inf"]["table"]["inf"]["500"]["accuracy"] = 84.44
    moved["trainings"]["8"]["table"]["0.3"]["50"]["accuracy"] = 87.0
    report = reference_report(moved, folder=results)
    assert report.splitlines()[-1] == (
        "Differs by -5.56 points (training without DP, non-private, n = 500: 84.44 against 90.00 +- 1.00; 12 cells "
        "compared; 10 within tolerance) from the reference made at revision abc1234 (served at def5678) on (torch "
        "2.14.1+cu130, CPU kernel AVX512, 1 thread).")
    assert "90.00 +- 1.00 (-5.56 !)" in report and "90.00 +- 1.00 (+1.90)" not in report   # that cell moved on
    assert "benchmarks/results/sweep_demo.json" in report and str(results.parent.parent) not in report


def test_the_floor_applies_where_the_reference_sem_is_zero_and_the_numerics_of_this_run_are_named(results):
    (results / "sweep_demo.json").write_text(json.dumps(sweep(sem=0.0)))
    slightly = sweep(accuracy=90.9)
    assert reference_report(slightly, folder=results).splitlines()[-1].startswith("Reproduced within tolerance")
    beyond = sweep(accuracy=91.2)
    for training in beyond["trainings"].values():
        training["training"]["numerics"]["cpu_capability"] = "AVX2"
    last = reference_report(beyond, folder=results).splitlines()[-1]
    assert last.startswith("Differs by +1.20 points") and "0 within tolerance" in last
    assert last.endswith("this run: (torch 2.14.1+cu130, CPU kernel AVX2, 1 thread).")


def test_only_common_cells_are_compared_and_the_grid_and_device_are_not_settings(results):
    smaller = sweep(sizes=[500], train_epsilons=["inf"], device="cuda")
    del smaller["trainings"]["8"]
    for level in smaller["trainings"]["inf"]["table"].values():
        del level["50"]
    assert len(compare_cells(smaller, sweep())) == 3
    assert "(3 cells compared; 3 within tolerance)" in reference_report(smaller, folder=results)
    # without a private training in common, the rounds of private trainings do not matter
    assert settings_differences(sweep(private_rounds=40)["config"], sweep()["config"], private=False) == []
    assert settings_differences(sweep(private_rounds=40)["config"], sweep()["config"]) == [
        "private_rounds: here 40, reference 20"]


def test_other_settings_a_missing_folder_and_a_bad_file_are_said_not_refused(results, tmp_path):
    other = reference_report(sweep(rounds=50), folder=results)
    assert other == ("Reference: no reference for these settings: the stored sweeps in "
                     "benchmarks/results were made with others (the closest, sweep_demo.json: rounds: here 50, "
                     "reference 200).")
    assert "does not exist (an installation without the repository's benchmarks folder); pass --reference FILE" in (
        reference_report(sweep(), folder=tmp_path / "absent"))
    assert "is not a file" in reference_report(sweep(), tmp_path / "absent.json")
    assert "is not a sweep result" in reference_report(sweep(), results / "other.json")
    explicit = reference_report(sweep(seed=1), results / "sweep_demo.json")
    assert explicit.startswith("Reference: no reference for these settings") and "seed: here 1, reference 0" in explicit


def test_a_setting_the_reference_predates_counts_as_its_default(results):
    newer = sweep(source_options={})
    assert find_reference(newer, results)[0] is None                        # unknown without the defaults
    assert find_reference(newer, results, defaults={"source_options": {}})[0] == results / "sweep_demo.json"
    assert find_reference(sweep(source_options={"path": "x"}), results, defaults={"source_options": {}})[0] is None


def test_the_reference_with_the_most_common_cells_is_chosen(results):
    fuller = sweep()
    fuller["trainings"]["inf"]["table"]["1"] = fuller["trainings"]["inf"]["table"]["0.3"]
    (results / "sweep_demo_more.json").write_text(json.dumps(fuller))
    assert find_reference(fuller, results)[0].name == "sweep_demo_more.json"
    assert find_reference(sweep(), results)[0].name == "sweep_demo.json"      # a tie: the first by name
