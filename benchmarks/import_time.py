"""Start-up cost: how long ``import privfl``, ``privfl --help`` and ``import privfl.methods`` take beyond Python's
own start, for one or more checkouts, measured side by side.

Each measurement is a fresh interpreter (``python -c ...`` or ``python -m privfl.cli --help``) with the checkout
first on ``PYTHONPATH``; the checkouts and commands alternate within each repeat, so a busy machine slows them alike,
and the figure is the median over repeats of (wall time - a bare ``python -c pass`` measured in the same repeat). It
also records which heavy packages each command left in ``sys.modules``.

    python benchmarks/import_time.py [--checkout after=.] [--checkout before=/path/to/a/checkout] [--repeats 7]

A checkout is ``LABEL=PATH`` (or a path, labelled by its folder name); the results are keyed by label.

Writes benchmarks/results/import_time.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("torch", "torchvision", "torch._dynamo", "numpy", "scipy", "dp_accounting", "opacus", "matplotlib")

#: name -> the Python code run (``None``: ``python -m privfl.cli --help``)
COMMANDS = {
    "python_start": "pass",
    "import privfl": "import privfl",
    "privfl --help": None,
    "import privfl.methods": "import privfl.methods",
}

_REPORT = "import json, sys; print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"


def run_once(checkout: Path, code: str | None) -> tuple[float, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    if code is None:   # the console script's work; what it imported is asked of a second interpreter below
        argv = [sys.executable, "-m", "privfl.cli", "--help"]
    else:
        argv = [sys.executable, "-c", f"{code}\n{_REPORT.format(heavy=HEAVY)}"]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    if code is None:
        probe = ("import sys, runpy\nsys.argv = ['privfl', '--help']\ntry:\n    runpy.run_module('privfl.cli', "
                 "run_name='__main__')\nexcept SystemExit:\n    pass\n" + _REPORT.format(heavy=HEAVY))
        done = subprocess.run([sys.executable, "-c", probe], cwd=checkout, env=env, capture_output=True, text=True,
                              check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    return wall, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", action="append", default=None, metavar="[LABEL=]PATH",
                        help="a privfl checkout to measure (repeatable; default: this one, labelled 'this')")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "import_time.json")
    args = parser.parse_args()
    checkouts: dict[str, Path] = {}
    for text in args.checkout or [f"this={Path(__file__).resolve().parents[1]}"]:
        label, _, path = text.rpartition("=")
        checkouts[label or Path(path).resolve().name] = Path(path).resolve()
    walls: dict[str, dict[str, list[float]]] = {label: {name: [] for name in COMMANDS} for label in checkouts}
    loaded: dict[str, dict[str, list[str]]] = {label: {} for label in checkouts}
    for _ in range(args.repeats):
        for label, checkout in checkouts.items():
            for name, code in COMMANDS.items():
                wall, modules = run_once(checkout, code)
                walls[label][name].append(wall)
                loaded[label][name] = modules
    results = {}
    for label in checkouts:
        times = walls[label]
        start = times["python_start"]
        beyond = {name: statistics.median(t - s for t, s in zip(times[name], start))
                  for name in COMMANDS if name != "python_start"}
        results[label] = {"python_start_s": statistics.median(start), "beyond_start_s": beyond,
                          "heavy_modules_loaded": loaded[label]}
        print(f"{label}: python start {statistics.median(start):.3f} s")
        for name, value in beyond.items():
            print(f"  {name:<24} {value:6.3f} s beyond start   loads {', '.join(loaded[label][name]) or '-'}")
    from privfl.provenance import numerics  # imports torch: after the timings
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"repeats": args.repeats, "python": sys.version.split()[0], "results": results,
                                    "numerics": numerics()},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
