"""benchmarks/attack_mnist.py: per-image scores kept in the results, paired comparisons from them, and the run with
and without a (tiny) diffusion reconstructor."""

from __future__ import annotations

import csv
import gzip
import json
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
for _path in (str(_ROOT), str(_ROOT / "benchmarks")):
    if _path not in sys.path:   # see test_reconstruction.py: the real `accounting` package must win
        sys.path.insert(0, _path)

import attack_mnist as bench  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from attacks.decoders import DECODERS  # noqa: E402
from attacks.reconstruct_outputs import _SCORE_COLUMNS  # noqa: E402

torch.set_num_threads(1)


def _cell(values: dict[int, dict[str, list[float]]]) -> dict[int, dict[str, np.ndarray]]:
    return {s: {"index": np.arange(len(v["psnr"])), **{m: np.asarray(v[m], dtype=float) for m in bench.METRICS}}
            for s, v in values.items()}


def _key(attack: str) -> tuple:
    return ("raw", "inf", attack, "-", "per-feature", "target")


def test_per_image_scores_round_trip_through_the_gzipped_csv(tmp_path):
    rows = []
    for seed in (0, 1):
        for i in range(4):
            rows.append({"seed": seed, "source": "raw", "epsilon": "inf", "attack": "mlp", "estimate": "-",
                         "level": "per-feature", "unit": "target", "index": i, "matched": i,
                         "defender_image": 100 * seed + i, "psnr": 10.0 + i + 0.25 * seed, "lpips": 0.1 * i,
                         "ssim": 0.5 - 0.01 * i, "confidence": 0.9})
    rows.append({**rows[0], "seed": 0, "index": 4, "psnr": "inf"})   # an exact reconstruction
    source = tmp_path / "per_image_scores.csv"
    with open(source, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(_SCORE_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    packed = bench.write_scores(source, tmp_path / "a_scores.csv.gz")
    again = bench.write_scores(source, tmp_path / "b_scores.csv.gz")
    assert packed.read_bytes() == again.read_bytes()   # no time or name in the header: the same bytes
    assert gzip.decompress(packed.read_bytes()) == source.read_bytes()
    scores = bench.load_scores(packed)
    cell = scores[_key("mlp")]
    assert sorted(cell) == [0, 1]
    assert cell[0]["index"].tolist() == [0, 1, 2, 3, 4] and cell[1]["index"].tolist() == [0, 1, 2, 3]
    assert cell[0]["psnr"].tolist() == [10.0, 11.0, 12.0, 13.0, 100.0]   # infinite PSNR capped at 100 dB
    assert cell[1]["psnr"].tolist() == [10.25, 11.25, 12.25, 13.25]
    assert np.allclose(cell[1]["lpips"], [0.0, 0.1, 0.2, 0.3]) and np.allclose(cell[0]["ssim"][:4],
                                                                               [0.5, 0.49, 0.48, 0.47])


def test_a_paired_bootstrap_of_identical_scores_is_zero_and_of_a_constant_shift_is_the_shift():
    rng = np.random.default_rng(0)
    base = {s: {m: rng.normal(size=30).tolist() for m in bench.METRICS} for s in (0, 1, 2)}
    shifted = {s: {"psnr": [v + 0.49 for v in c["psnr"]], "lpips": [v - 0.04 for v in c["lpips"]],
                   "ssim": c["ssim"]} for s, c in base.items()}
    scores = {_key("a"): _cell(base), _key("b"): _cell(base), _key("c"): _cell(shifted)}
    same = bench.paired(scores, _key("a"), _key("b"), n_boot=200, seed=0)
    assert all(same[m]["low"] <= 0 <= same[m]["high"] and same[m]["mean"] == 0 for m in bench.METRICS)
    shift = bench.paired(scores, _key("c"), _key("a"), n_boot=200, seed=0)
    for metric, value in (("psnr", 0.49), ("lpips", -0.04), ("ssim", 0.0)):
        assert shift[metric]["mean"] == pytest.approx(value, abs=1e-12)
        assert shift[metric]["low"] == pytest.approx(value, abs=1e-12)
        assert shift[metric]["high"] == pytest.approx(value, abs=1e-12)
    # a paired difference needs the same images
    other = _cell(base)
    other[1]["index"] = other[1]["index"][::-1].copy()
    with pytest.raises(ValueError, match="different images in seed 1"):
        bench.paired({**scores, _key("d"): other}, _key("d"), _key("a"), n_boot=100, seed=0)


def test_the_leader_of_each_metric_is_separated_only_where_the_paired_interval_excludes_zero():
    rng = np.random.default_rng(1)
    noise = {s: rng.normal(size=(3, 200)) for s in (0, 1)}
    base = {s: {m: (0.5 + 0.1 * noise[s][i]).tolist() for i, m in enumerate(bench.METRICS)} for s in (0, 1)}

    def moved(psnr: float, lpips: float, jitter: float, seed: int) -> dict:
        r = np.random.default_rng(seed)
        return {s: {"psnr": (np.asarray(c["psnr"]) + psnr + jitter * r.normal(size=200)).tolist(),
                    "lpips": (np.asarray(c["lpips"]) + lpips + jitter * r.normal(size=200)).tolist(),
                    "ssim": (np.asarray(c["ssim"]) + jitter * r.normal(size=200)).tolist()} for s, c in base.items()}

    scores = {_key("best"): _cell(moved(1.0, -0.2, 0.01, 2)), _key("close"): _cell(moved(0.999, -0.199, 0.05, 3)),
              _key("worse"): _cell(base)}
    lead = bench.leaders(scores, list(scores), n_boot=300, seed=0)
    assert lead["psnr"]["attack"] == "best" and lead["lpips"]["attack"] == "best"   # lower LPIPS leads
    for metric in ("psnr", "lpips"):
        assert [o["attack"] for o in lead[metric]["separated_from"]] == ["worse"]
        assert [o["attack"] for o in lead[metric]["not_separated_from"]] == ["close"]
    assert lead["psnr"]["separated_from"][0]["mean"] == pytest.approx(1.0, abs=0.01)
    assert lead["lpips"]["separated_from"][0]["high"] < 0
    lines = bench._leader_lines(lead)
    assert len(lines) == 3 and "**not separated** from: close" in lines[0]
    assert bench.leaders(scores, [_key("best")], n_boot=100, seed=0) == {}


TINY = ["--dataset", "digits", "--input-size", "32", "--attacker-images", "100", "--validation-images", "10",
        "--defender-images", "20", "--seeds", "0,1", "--image-size", "16", "--block-channels", "8,16",
        "--layers-per-block", "1", "--condition-dims", "8", "--steps", "3", "--batch-size", "8", "--guidance", "1,2",
        "--guidance-rescales", "0", "--guidance-intervals", "0:1", "--init-strengths", "0.5", "--selection-images",
        "6", "--ddim-steps", "2", "--samples-per-feature", "2", "--set-samples-per-feature", "2", "--one-step-draws",
        "2", "--one-step-guidance", "1", "--mlp-hidden", "16", "--mlp-epochs", "2", "--tuned-epochs", "2",
        "--random-features", "64", "--top-fractions", "0.1", "--schemes", "raw", "--bootstrap", "100",
        "--prior-covariance", "diag"]


@pytest.mark.parametrize("decoders_only", [True, False], ids=["decoders-only", "tiny-reconstructor"])
def test_the_benchmark_keeps_every_scored_image_and_compares_each_reconstruction_pairwise(tmp_path, monkeypatch,
                                                                                          decoders_only):
    monkeypatch.setenv("PRIVFL_CACHE_DIR", str(tmp_path / "cache"))
    results = tmp_path / "results"
    only = ["--decoders-only"] if decoders_only else []
    # the reconstructor reads the tuned MLP's estimate (its training pairs: out-of-fold, from 2 fold models)
    guide = [] if decoders_only else ["--guide-decoder", "mlp-tuned", "--guide-folds", "2"]
    assert bench.main(["--preset", "reduced", *only, "--device", "cpu", "--work", str(tmp_path / "work"),
                       "--results", str(results), "--no-progress", "--", *TINY, *guide]) == 0
    stem = "attack_mnist_reduced" + ("_decoders" if decoders_only else "")
    for end in (".json", ".csv", ".md", "_scores.csv.gz", "_grid.png", "_metrics.png"):
        assert (results / f"{stem}{end}").is_file(), end
    summary = json.loads((results / f"{stem}.json").read_text())
    scores = bench.load_scores(results / f"{stem}_scores.csv.gz")
    raw = {k[2:4] for k in scores if k[0] == "raw" and k[4:] == ("per-feature", "target")}
    assert {d for d, _ in raw if d != "diffusion"} == set(DECODERS)
    diffusion = sorted(e for d, e in raw if d == "diffusion")
    assert (summary["reconstructor"] is None) == decoders_only and (not diffusion) == decoders_only
    if not decoders_only:   # the guide is the tuned MLP's chosen configuration, cross-fitted, and its table row
        assert summary["guide_decoder"]["name"] == "mlp-tuned" and summary["guide_decoder"]["folds"] == 2
        assert summary["guide_decoder"]["chosen"] == summary["decoders"]["mlp-tuned"]["chosen"]
        assert summary["reconstructor"]["config"]["guide_image"] and summary["sampling"]["init_decoder"] == "mlp-tuned"
    comparisons = summary["comparisons"]
    # every reconstruction against the project's MLP, and against every decoder for each diffusion estimate
    assert {(c["attack"], c["estimate"]) for c in comparisons["against_reference"]} == raw - {("mlp", "-")}
    assert {(c["diffusion"], c["decoder"]) for c in comparisons["headline"]} == {(e, d) for e in diffusion
                                                                                for d in DECODERS}
    # the leader's paired differences come back from the per-image scores kept in the results
    for metric, lead in comparisons["leaders"].items():
        others = lead["separated_from"] + lead["not_separated_from"]
        assert len(others) == len(raw) - 1
        first = others[0]
        again = bench.paired(scores, ("raw", "inf", lead["attack"], lead["estimate"], "per-feature", "target"),
                             ("raw", "inf", first["attack"], first["estimate"], "per-feature", "target"),
                             n_boot=100, seed=0)
        assert again[metric]["mean"] == pytest.approx(first["mean"], abs=1e-12)
    # the CSV's pooled row is the mean of the per-seed means of the kept per-image scores
    with open(results / f"{stem}.csv", newline="") as stream:
        row = next(r for r in csv.DictReader(stream) if (r["source"], r["attack"], r["level"], r["selection"],
                                                         r["seed"]) == ("raw", "mlp-tuned", "per-feature", "all",
                                                                        "all"))
    cell = scores[("raw", "inf", "mlp-tuned", "-", "per-feature", "target")]
    assert float(row["psnr"]) == pytest.approx(np.mean([cell[s]["psnr"].mean() for s in cell]), rel=1e-9)
    # the tuning of every tuned decoder is recorded with its CPU time, and shown on the page
    for name in ("mlp-tuned", "conv", "random-features"):
        grid = summary["decoders"][name]["grid"]
        assert grid and all(c["cpu_s"] >= 0 and c["held_out_mse"] > 0 for c in grid)
    assert all(summary["decoders"][name]["cpu_s"] >= 0 for name in DECODERS)
    page = (results / f"{stem}.md").read_text()
    assert "Which reconstruction leads on each metric" in page and "Every candidate of the tuned decoders" in page
    assert ("No diffusion reconstructor in this run" in page) == decoders_only
    assert ("diffusion minus decoder" in page) != decoders_only
    # the page is rewritten from the JSON and the CSV alone
    (results / f"{stem}.md").unlink()
    assert bench.main(["--preset", "reduced", *only, "--results", str(results), "--render-only"]) == 0
    assert (results / f"{stem}.md").read_text() == page
