"""The privfl command: train, sweep, demo, report, ledger, features, datasets, attack (audit, reconstruct), flower.

A user error (an unknown name, a value out of range, unreadable data) exits with status 2 and one message that
names the bad value and the valid choices; it never prints a traceback. A fault inside privfl
(:class:`~privfl.errors.InternalError`) is a bug: it shows its traceback, asks for a report and exits with status 70
(``EX_SOFTWARE``); any other exception nothing expected keeps Python's traceback and exit status 1.

:func:`main` is the command; its parser is :mod:`privfl.cli.parsers`, each subcommand's work
:mod:`privfl.cli.commands`, and the options several commands share :mod:`privfl.cli.options`.
"""

from __future__ import annotations

import math
import os
import sys

from privfl.cli.parsers import build_parser
from privfl.errors import InternalError, PrivflError


def main(argv: list[str] | None = None) -> int:
    """The ``privfl`` command. A Ctrl-C anywhere, even while torch is still being imported, ends it with
    ``privfl: interrupted`` and exit status 130, never a traceback (long work saves what it has first)."""
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        print("privfl: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    # a Ctrl-C anywhere below ends in main's one line (long work saves what it has first)
    if argv[:1] == ["flower"]:
        from privfl.engines.flower.launch import main as flower_main

        return flower_main(argv[1:])
    if argv[:2] == ["attack", "audit"]:
        from attacks.audit import audit_main

        return audit_main(argv[2:])
    if argv[:2] == ["attack", "reconstruct"]:
        from attacks.reconstruct_cli import reconstruct_main

        return reconstruct_main(argv[2:])
    args = build_parser().parse_args(argv)
    for name in ("lr", "mu", "server_lr", "weight_decay", "grad_clip", "lr_decay", "alpha", "novel_fraction",
                 "client_fraction", "delta"):
        value = getattr(args, name, None)
        if isinstance(value, float) and not math.isfinite(value):
            print(f"privfl: error: --{name.replace('_', '-')} must be a finite number, got {value}", file=sys.stderr)
            return 2
    from privfl.experiment import RunInterrupted
    from privfl.memory import reuse_freed_memory

    reuse_freed_memory()   # large per-round tensors from the heap, not fresh page-faulted mmaps (privfl.memory)
    threads = getattr(args, "threads", None)
    if threads is None and getattr(args, "workers", 1) > 1:
        threads = 1   # each worker computes on one thread, and this process must too (privfl.federation.workers)
    if threads is not None:
        if threads < 1:
            print(f"privfl: error: --threads must be an integer >= 1, got {threads}", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(threads)
    from accounting import BudgetExceededError

    try:
        return args.func(args)
    except RunInterrupted as interrupted:
        print(f"privfl: {interrupted}", file=sys.stderr)
        return 130
    except PrivflError as error:
        print(f"privfl: error: {error}", file=sys.stderr)
        return 2
    except BudgetExceededError as refused:    # a release refused before it was sent: nothing was lost
        print(f"privfl: refused: {refused}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a command that stopped reading (e.g. head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except InternalError:
        return report_bug()


#: Exit status of a fault inside privfl (``EX_SOFTWARE`` of BSD's sysexits.h).
EXIT_INTERNAL = 70


def report_bug() -> int:
    """Print the exception being handled with its traceback and a request to report it; return
    :data:`EXIT_INTERNAL`."""
    import traceback

    traceback.print_exc()
    print("privfl: internal error: this is a bug in privfl, not a problem with your input; please report it with "
          "the traceback above and the command you ran", file=sys.stderr)
    return EXIT_INTERNAL

