"""What a run's records cost on disk: a bound per release, derived from the formats, on a small central-DP run.

A round of central DP makes one release per sampled client (its contribution, to the trusted aggregator) and one
release for every training client (the noisy aggregate). The journal (``releases.jsonl``) writes each client's release
as one short line naming an earlier line's record, and the aggregate's client list once; ``ledger.json`` keeps each
record once as ``[kind, round, time]`` and each ledger as a list of indices. Before, every line and every ledger entry
repeated the whole record: about 290 bytes a release in the journal and 250 in the ledger (18 MB for 40 rounds of a
thousand clients, where the bounds below give under 3 MB).
"""

import json

from accounting import LedgerBook, ReleaseJournal
from privfl.experiment import train
from privfl.federation import RunDirectory
from privfl.privacy.training import TrainingPrivacy

#: A compact journal line: {"p":<16 hex>,"c":<id>,"s":<line>,"t":<unix time>} and its newline, ids and line numbers
#: below a million: 2 + 22 + 11 + 11 + 24 + 1 = 71 bytes, rounded up.
LINE = 80
#: A record in full (event, purpose, round, time, metadata, audience), as the first line of its kind each round holds
#: it; a central aggregate's record carries its settings in its metadata.
RECORD = 600
#: A client id in a list, with its comma (ids below a million).
ID = 8


def test_a_central_dp_run_writes_a_short_line_per_release_and_a_few_bytes_per_ledger_entry(tmp_path, make_spec):
    from privfl.config import RunConfig

    rounds, clients = 12, 40
    spec = make_spec(num_clients=clients + 10, partition="iid", novel_fraction=0.2,
                     source_options={"num_samples": 2000, "dim": 6, "num_classes": 3})
    config = RunConfig(federation=spec, method="fedavg", method_config={"local_steps": 1, "batch_size": 16},
                       rounds=rounds, client_fraction=0.5, eval_every=rounds, checkpoint_every=4, select="last",
                       seed=1, privacy=TrainingPrivacy(mode="central", noise_multiplier=1.0, clip="adaptive",
                                                       noise="seeded", noise_seed=2))
    train(config, str(tmp_path / "run"), progress=False)
    run = RunDirectory(tmp_path / "run")
    journal = ReleaseJournal(run.path(RunDirectory.RELEASES))
    entries = journal.entries()
    lines = run.path(RunDirectory.RELEASES).read_bytes().splitlines()
    training = {cid for cid, record in entries if record.purpose == "central_aggregate"}
    contributions = sum(record.purpose == "model_update" for _, record in entries)
    assert len(training) == clients and contributions > rounds * clients / 4       # Poisson at 0.5: about 240
    assert len(lines) == contributions + rounds + len(journal.marks())

    # the journal: a line per contribution, a record in full twice a round, the client list once
    journal_bytes = run.path(RunDirectory.RELEASES).stat().st_size
    assert journal_bytes <= LINE * len(lines) + 2 * RECORD * rounds + ID * clients
    assert sum(len(line) > LINE for line in lines) <= 2 * rounds + len(journal.marks())

    # ledger.json: each distinct record once, each ledger entry an index
    book = LedgerBook.load(run.path(RunDirectory.LEDGER))
    state = json.loads(run.path(RunDirectory.LEDGER).read_text())
    assert len(state["records"]) == contributions + rounds and len(state["kinds"]) <= 4
    entries_held = sum(len(ledger) for ledger in book.values())
    assert entries_held == contributions + rounds * clients
    ledger_bytes = run.path(RunDirectory.LEDGER).stat().st_size
    assert ledger_bytes <= 40 * len(state["records"]) + ID * entries_held + 120 * len(book) + RECORD * 4
    # the records read back as they were made: the journal and ledger.json hold the same releases
    replayed = LedgerBook()
    journal.replay_into(replayed)
    assert {cid: ledger.records for cid, ledger in replayed.items()} == {cid: ledger.records
                                                                       for cid, ledger in book.items()}
