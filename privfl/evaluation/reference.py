"""Whether a sweep reproduced the published figures: its cells beside those of the stored sweep with the same settings.

The repository keeps the main job's figures under ``benchmarks/results/`` (``sweep_demo.json`` is ``make demo``'s,
written by ``privfl sweep`` as ``OUT/sweep.json``). :func:`reference_report` finds there the stored sweep made with
the same settings (:func:`settings_differences`: everything but the grid, whose common cells are compared, and the
device), or reads the file it is given, and compares every cell present in both: training epsilon x novel epsilon
(and the controls) x n. It never stops a sweep: a missing folder, a file of other settings or an unreadable one is
said in the report.

Tolerance per cell: the larger of :data:`SEM_FACTOR` (2) standard errors of the reference cell and
:data:`FLOOR_POINTS` (1 accuracy point). The SEM is over the reference's label mixes, so 2 SEM is about how far a
mean of that many mixes moves between two draws; the floor covers cells whose mixes all scored alike (SEM near 0),
where a repeat in another floating-point environment (torch, CPU kernel, threads: :mod:`privfl.provenance`) still
moves a model by a fraction of a point. A repeat on the same code and numerics matches to the last digit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privfl.federation.rundir import to_json_safe

__all__ = ["FLOOR_POINTS", "IGNORED_SETTINGS", "REFERENCE_DIR", "SEM_FACTOR", "CellComparison", "compare_cells",
           "find_reference", "reference_report", "settings_differences"]

#: The repository's results folder, beside the package (absent from an installed copy without the repository).
REFERENCE_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

#: Tolerance per cell: max(SEM_FACTOR x the reference cell's SEM, FLOOR_POINTS) accuracy points.
SEM_FACTOR = 2.0
FLOOR_POINTS = 1.0

#: Settings that do not make a reference another experiment: the grid (the cells both hold are compared) and where
#: the trainings computed (its numerics are reported beside the verdict).
IGNORED_SETTINGS = ("train_epsilons", "epsilons", "sizes", "device")

_LABELS = {"inf": "non-private", "control_mean_training": "control: mean training descriptor",
           "control_other_mix": "control: another mix's descriptor"}


@dataclass(frozen=True)
class CellComparison:
    """One cell in both sweeps: accuracy (%) here and in the reference, the reference's SEM, the tolerance."""

    training: str        #: training epsilon key ("inf": without DP)
    level: str           #: novel epsilon key, "inf" or a control
    n: str
    accuracy: float
    reference: float
    reference_sem: float
    tolerance: float

    @property
    def difference(self) -> float:
        return self.accuracy - self.reference

    @property
    def within(self) -> bool:
        return abs(self.difference) <= self.tolerance


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples as lists, non-finite floats as strings)."""
    return json.loads(json.dumps(to_json_safe(value), default=str))


def _number(value: Any) -> float:
    try:
        return float(value)          # "nan" and "inf" as stored by to_json_safe too
    except (TypeError, ValueError):
        return math.nan


def _is_sweep(data: Any) -> bool:
    return (isinstance(data, dict) and isinstance(data.get("config"), dict) and isinstance(data.get("trainings"), dict)
            and all(isinstance(t, dict) and "table" in t for t in data["trainings"].values()))


def settings_differences(config: Mapping[str, Any], reference: Mapping[str, Any], *,
                         defaults: Mapping[str, Any] | None = None, private: bool = True) -> list[str]:
    """The settings in which ``reference``'s config differs from ``config``'s, as ``"name: here X, reference Y"``.

    :data:`IGNORED_SETTINGS` are not compared, nor ``private_rounds`` unless ``private`` (a private training is
    among the compared ones). A setting the reference does not record (it predates it) counts as its value in
    ``defaults`` when given, else as a difference.
    """
    config, reference = _plain(config), _plain(reference)
    known = _plain(defaults) if defaults is not None else {}
    ignored = set(IGNORED_SETTINGS) | (set() if private else {"private_rounds"})
    differences = []
    for name in sorted((set(config) | set(reference)) - ignored):
        here = config.get(name, known.get(name, "(not recorded)"))
        there = reference[name] if name in reference else known.get(name, "(not recorded)")
        if here != there:
            differences.append(f"{name}: here {here}, reference {there}")
    return differences


def compare_cells(result: Mapping[str, Any], reference: Mapping[str, Any], *, sem_factor: float = SEM_FACTOR,
                  floor: float = FLOOR_POINTS) -> list[CellComparison]:
    """Every (training, level, n) whose accuracy is finite in both, with its tolerance (module docstring)."""
    result, reference = _plain(result), _plain(reference)
    cells = []
    for training, ours in result["trainings"].items():
        theirs = reference["trainings"].get(training)
        if theirs is None:
            continue
        for level, row in ours["table"].items():
            for n, cell in row.items():
                stored = theirs["table"].get(level, {}).get(n)
                if stored is None:
                    continue
                accuracy, expected = _number(cell["accuracy"]), _number(stored["accuracy"])
                if not (math.isfinite(accuracy) and math.isfinite(expected)):
                    continue
                sem = _number(stored.get("sem"))
                tolerance = max(sem_factor * sem, floor) if math.isfinite(sem) else floor
                cells.append(CellComparison(training, level, n, accuracy, expected, sem, tolerance))
    return cells


def find_reference(result: Mapping[str, Any], folder: Path = REFERENCE_DIR, *,
                   defaults: Mapping[str, Any] | None = None) -> tuple[Path | None, str]:
    """The stored sweep in ``folder`` with ``result``'s settings holding the most common cells (ties: the first by
    name), and ``""``; or ``None`` and why there is none."""
    if not folder.is_dir():
        return None, (f"no reference: {folder} does not exist (an installation without the repository's benchmarks "
                      "folder); pass --reference FILE to compare with a stored sweep.json")
    best: tuple[int, Path] | None = None
    closest: tuple[int, Path, list[str]] | None = None
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not _is_sweep(data):
            continue
        differences = _differences(result, data, defaults)
        if differences:
            if closest is None or len(differences) < closest[0]:
                closest = (len(differences), path, differences)
            continue
        common = len(compare_cells(result, data))
        if common and (best is None or common > best[0]):
            best = (common, path)
    if best is not None:
        return best[1], ""
    if closest is None:
        return None, f"no reference: {folder} holds no stored sweep"
    return None, (f"no reference for these settings: the stored sweeps in {_shown(folder, folder)} were made with "
                  f"others (the closest, {closest[1].name}: {'; '.join(closest[2])})")


def _differences(result: Mapping[str, Any], reference: Mapping[str, Any],
                 defaults: Mapping[str, Any] | None) -> list[str]:
    common = set(result["trainings"]) & set(reference["trainings"])
    return settings_differences(result["config"], reference["config"], defaults=defaults,
                                private=any(key != "inf" for key in common))


def _shown(path: Path, folder: Path = REFERENCE_DIR) -> str:
    """``path`` relative to the checkout that holds ``folder`` (``<checkout>/benchmarks/results``) when inside it,
    so a report that may be published names no machine's folders; else as given."""
    try:
        return str(path.resolve().relative_to(folder.resolve().parents[1]))
    except (ValueError, IndexError):
        return str(path)


def _environment(numerics: Mapping[str, Any] | None) -> str:
    if not numerics:
        return "(numerics not recorded)"
    threads = numerics.get("threads")
    return (f"(torch {numerics.get('torch')}, CPU kernel {numerics.get('cpu_capability')}, {threads} "
            f"thread{'' if str(threads) == '1' else 's'})")


def _made_at(reference: Mapping[str, Any], training: str) -> tuple[str, Mapping[str, Any] | None]:
    """The revision and numerics of a reference training, with the serving process's revision when it differs."""
    numerics = reference["trainings"][training].get("training", {}).get("numerics") or reference.get("numerics")
    revision = (numerics or {}).get("code_revision") or "unknown"
    served = (reference.get("numerics") or {}).get("code_revision")
    return revision + (f" (served at {served})" if served and served != revision else ""), numerics


def reference_report(result: Mapping[str, Any], reference: str | Path | None = None, *,
                     defaults: Mapping[str, Any] | None = None, folder: Path = REFERENCE_DIR) -> str:
    """The reference figures beside this sweep's, and a last line: ``reproduced within tolerance`` or ``differs by
    X points from the reference made at revision R on (torch, CPU kernel, threads)``, or why there is no reference.

    ``result``: what :func:`privfl.sweep.run_sweep` returns. ``reference``: a stored sweep result to compare with
    (default: the one in ``folder`` with the same settings, :func:`find_reference`). ``defaults``: the sweep's
    default settings, standing in for settings a reference predates.
    """
    result = _plain(result)
    if reference is None:
        path, why = find_reference(result, folder, defaults=defaults)
        if path is None:
            return f"Reference: {why}."
    else:
        path = Path(reference)
        if not path.is_file():
            return f"Reference: no reference: --reference {reference} is not a file."
    shown = _shown(path, folder) if reference is None else str(reference)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return f"Reference: no reference: {shown} could not be read as JSON ({error})."
    if not _is_sweep(stored):
        return (f"Reference: no reference: {shown} is not a sweep result (no 'config' and 'trainings' with "
                "tables, as privfl sweep writes sweep.json).")
    differences = _differences(result, stored, defaults)
    if differences:
        return (f"Reference: no reference for these settings: {shown} was made with others "
                f"({'; '.join(differences)}).")
    cells = compare_cells(result, stored)
    if not cells:
        return (f"Reference: {shown} has the same settings but no cell in common with this sweep "
                f"(its trainings: {', '.join(stored['trainings'])}; its sizes: {stored['config'].get('sizes')}).")
    lines = [f"### Reference: {shown}: accuracy (%) +- SEM there, and this run minus it (points; `!`: "
             f"outside the tolerance, max({SEM_FACTOR:g} SEM, {FLOOR_POINTS:g} point))"]
    for training in dict.fromkeys(c.training for c in cells):
        made, numerics = _made_at(stored, training)
        mine = [c for c in cells if c.training == training]
        sizes = list(dict.fromkeys(c.n for c in mine))
        title = "training clients without DP" if training == "inf" else f"training epsilon {training}"
        lines += ["", f"{title}: made at {made} on {_environment(numerics)}", "",
                  "| novel epsilon \\ n | " + " | ".join(sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for level in dict.fromkeys(c.level for c in mine):
            row = {c.n: c for c in mine if c.level == level}
            lines.append(f"| {_LABELS.get(level, level)} | " + " | ".join(_cell(row.get(n)) for n in sizes) + " |")
    outside = [c for c in cells if not c.within]
    compared = f"{len(cells)} cells compared; {len(cells) - len(outside)} within tolerance"
    if not outside:
        lines += ["", f"Reproduced within tolerance ({compared}) of the reference {shown}."]
        return "\n".join(lines)
    worst = max(outside, key=lambda c: abs(c.difference))
    made, numerics = _made_at(stored, worst.training)
    where = (f"{'training without DP' if worst.training == 'inf' else 'training epsilon ' + worst.training}, "
             f"{_LABELS.get(worst.level, 'novel epsilon ' + worst.level)}, n = {worst.n}: {worst.accuracy:.2f} "
             f"against {worst.reference:.2f} +- {worst.reference_sem:.2f}")
    here = (result["trainings"][worst.training].get("training") or {}).get("numerics")
    environment = _environment(numerics)
    elsewhere = "" if _environment(here) == environment else f"; this run: {_environment(here)}"
    lines += ["", f"Differs by {worst.difference:+.2f} points ({where}; {compared}) from the reference made at "
                  f"revision {made} on {environment}{elsewhere}."]
    return "\n".join(lines)


def _cell(c: CellComparison | None) -> str:
    if c is None:
        return "-"
    sem = f" +- {c.reference_sem:.2f}" if math.isfinite(c.reference_sem) else ""
    return f"{c.reference:.2f}{sem} ({c.difference:+.2f}{'' if c.within else ' !'})"
