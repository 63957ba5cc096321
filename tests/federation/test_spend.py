"""`privfl ledger` and `privfl report` on unfinished and damaged runs: epsilons recomputed from the recorded releases,
disagreements named, damaged files named in one line."""

import json

import pytest

from accounting import LedgerBook, ReleaseJournal
from privfl.cli import main
from privfl.experiment import RunInterrupted, train
from privfl.federation.spend import read_spend, run_summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """One finished and one unfinished run (stopped after round 3 of 4) of the same config."""
    from conftest import tiny_dp_config

    root = tmp_path_factory.mktemp("runs")
    train(tiny_dp_config(), str(root / "finished"), progress=False)
    with pytest.raises(RunInterrupted):
        train(tiny_dp_config(), str(root / "unfinished"), progress=False, stop_after_round=3)
    return root


def _journal_epsilons(path, delta=1e-5):
    book = LedgerBook()
    ReleaseJournal(path).replay_into(book)
    return book.epsilons(delta)


def test_ledger_and_report_read_an_unfinished_run_from_its_journal(runs, capsys):
    run = runs / "unfinished"
    assert not (run / "ledger.json").exists() and not (run / "summary.json").exists()
    assert main(["ledger", str(run)]) == 0
    out = capsys.readouterr().out
    assert "unfinished: 3 of 4 rounds in its last checkpoint" in out and "releases.jsonl" in out
    assert "model_update x3" in out
    spend = read_spend(run)
    assert spend.epsilons() == _journal_epsilons(run / "releases.jsonl") and len(spend.epsilons()) == 4
    assert main(["report", str(run), str(runs / "finished")]) == 0
    table = capsys.readouterr().out
    unfinished_row = next(line for line in table.splitlines() if str(run) in line)
    assert "unfinished" in unfinished_row and "3/4" in unfinished_row and "seeded*" in unfinished_row
    assert "finished" in next(line for line in table.splitlines() if str(runs / "finished") in line)
    assert "* seeded noise" in table                       # the caveat the summary carries, under the table
    epsilon = max(_journal_epsilons(run / "releases.jsonl").values())
    assert run_summary(run)["privacy"]["epsilon_max_training"] == pytest.approx(epsilon)


def test_a_cut_journal_is_counted_from_the_longer_record_with_a_warning(runs, tmp_path, capsys):
    import shutil

    run = tmp_path / "finished"
    shutil.copytree(runs / "finished", run)
    full = read_spend(run).epsilons()
    lines = (run / "releases.jsonl").read_text().splitlines()
    (run / "releases.jsonl").write_text("\n".join(lines[:5]) + "\n")     # cut: the chain holds, the count does not
    assert main(["ledger", str(run)]) == 0
    captured = capsys.readouterr()
    assert "releases.jsonl holds 1 releases, ledger.json 4" in captured.err
    assert read_spend(run).epsilons() == full                             # never below what ledger.json records
    assert main(["report", str(run)]) == 0
    assert "record different releases" in capsys.readouterr().err


@pytest.mark.parametrize("damage,needle", [
    ("ledger_cut", "ledger.json is damaged (not JSON"),
    ("ledger_list", "ledger.json is damaged (not a ledger book: expected a state with format"),
    ("ledger_negative", "ledger.json is damaged (not a ledger book: noise_multiplier must be"),
    ("journal_edited", "releases.jsonl is damaged: line 4 does not follow line 3"),
    ("journal_not_json", "releases.jsonl is damaged: line 2 is not JSON"),
])
@pytest.mark.parametrize("command", ["ledger", "report"])
def test_a_damaged_ledger_or_journal_is_named_in_one_line(runs, tmp_path, capsys, damage, needle, command):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs / "finished", run)
    ledger, journal = run / "ledger.json", run / "releases.jsonl"
    if damage == "ledger_cut":
        ledger.write_text(ledger.read_text()[:300])
    elif damage == "ledger_list":
        ledger.write_text("[]")
    elif damage == "ledger_negative":
        ledger.write_text(ledger.read_text().replace('"noise_multiplier":1.0', '"noise_multiplier":-1.0'))
    else:
        lines = journal.read_text().splitlines()
        if damage == "journal_not_json":
            lines[1] = "{not json"
        else:                                           # line 3's record edited: another round, or another time
            entry = json.loads(lines[2])
            entry.update({"r": {**entry["r"], "round": 2}} if "r" in entry else {"t": entry["t"] + 1.0})
            lines[2] = json.dumps(entry)
        journal.write_text("\n".join(lines) + "\n")
    assert main([command, str(run)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_run_without_any_file_of_releases_has_spent_nothing_and_says_so(tmp_path, tiny_config, capsys):
    from privfl.federation import RunDirectory

    RunDirectory(tmp_path / "run").create(json.loads(json.dumps(tiny_config().to_dict())))
    assert main(["ledger", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "unfinished" in out and "0 clients with releases" in out


def _forge(run, client):
    """Drop ``client``'s last release from the journal (its hash chain recomputed, so the journal reads as intact)
    and from ledger.json alike: what a tamperer who knows the format does. summary.json is left as the run wrote it."""
    from accounting import PrivacyLedger

    path = run / "releases.jsonl"
    entries, marks = ReleaseJournal(path).entries(), ReleaseJournal(path).marks()
    last = max(i for i, (cid, _) in enumerate(entries) if cid == client)
    del entries[last]
    path.unlink()
    journal = ReleaseJournal(path)                 # written again by privfl's own writer: the chain is intact
    for cid, record in entries:
        journal.append(cid, record)
    for mark in marks:                             # the end of the novel clients' service, after their releases
        journal.mark(mark.pop("mark"), **mark)
    book = LedgerBook.load(run / "ledger.json")
    forged = LedgerBook()
    for cid, ledger in book.items():
        state = ledger.state_dict()
        if cid == client:
            state = {**state, "records": state["records"][:-1]}
        forged.add(PrivacyLedger.from_state_dict(state))
    forged.save(run / "ledger.json")


def test_a_journal_and_ledger_forged_alike_do_not_lower_the_reported_epsilon(runs, tmp_path, capsys):
    import shutil

    run = tmp_path / "finished"
    shutil.copytree(runs / "finished", run)
    summary = json.loads((run / "summary.json").read_text())
    client = next(int(c) for c, e in summary["privacy"]["epsilon_per_client"].items() if e > 0)
    true = summary["privacy"]["epsilon_per_client"][str(client)]
    _forge(run, client)
    forged = LedgerBook()
    ReleaseJournal(run / "releases.jsonl").replay_into(forged)           # the forged chain reads as intact
    assert forged.epsilons(1e-5)[client] < true
    spend = read_spend(run)
    assert spend.epsilons()[client] == pytest.approx(true)
    assert any(f"client {client}: summary.json states epsilon" in w for w in spend.warnings), spend.warnings
    assert main(["ledger", str(run)]) == 0
    captured = capsys.readouterr()
    assert f"client {client}: summary.json states epsilon" in captured.err and "the larger" in captured.err
    row = next(line for line in captured.out.splitlines() if line.split() and line.split()[0] == str(client))
    assert float(row.split()[2]) == pytest.approx(true, rel=1e-2)     # as printed, to 3 digits
    report = run_summary(run)
    assert report["privacy"]["epsilon_per_client"][str(client)] == pytest.approx(true)
    assert report["warnings"]
    # resuming the finished run cross-checks the three records too, and warns
    resumed = train(None, str(run), resume=True, progress=False)
    assert resumed["privacy"]["epsilon_per_client"][str(client)] == pytest.approx(true)
    assert "summary.json states epsilon" in capsys.readouterr().err


def test_an_edited_summary_is_caught_by_report_and_the_recorded_figure_is_shown(runs, tmp_path, capsys):
    import shutil

    run = tmp_path / "finished"
    shutil.copytree(runs / "finished", run)
    summary = json.loads((run / "summary.json").read_text())
    true = dict(summary["privacy"]["epsilon_per_client"])
    summary["privacy"]["epsilon_per_client"] = {c: 0.01 for c in true}
    summary["privacy"]["epsilon_max_training"] = 0.01
    (run / "summary.json").write_text(json.dumps(summary))
    report = run_summary(run)
    assert report["privacy"]["epsilon_max_training"] == pytest.approx(max(true.values()))
    assert any("states epsilon 0.01" in w for w in report["warnings"])
    assert main(["report", str(run)]) == 0
    assert "states epsilon 0.01" in capsys.readouterr().err


def test_ledger_recomputes_a_flower_runs_lifetime_column_from_its_node_ledgers(runs, tmp_path, capsys):
    # A Flower run saves the node ledgers it was reported (node-ledgers.json: every run's records on each client's
    # node); `privfl ledger` recomputes the lifetime column from them at --delta, never copying summary.json's.
    import shutil

    from accounting import PrivacyLedger
    from accounting.ledger import ReleaseRecord
    from privfl.evaluation.report import format_epsilon
    from privfl.federation.spend import read_lifetime

    run = tmp_path / "finished"
    shutil.copytree(runs / "finished", run)
    this_run = LedgerBook.load(run / "ledger.json")
    lifetime = LedgerBook()
    for cid in this_run:
        ledger = PrivacyLedger(cid)
        for tag in ("earlier", "this"):            # each release made once in an earlier run, once in this one
            for record in this_run[cid].records:
                ledger._append_history(ReleaseRecord.from_dict(
                    {**record.to_dict(), "metadata": {**record.metadata, "run": tag}}))
        lifetime.add(ledger)
    lifetime.save(run / "node-ledgers.json")
    summary = json.loads((run / "summary.json").read_text())
    client = str(next(iter(this_run)))
    understated = {str(cid): 0.5 for cid in this_run}
    understated[client] = 1e6                      # one figure above what the ledgers give: reported, with a warning
    summary["flower"] = {"lifetime": {"run_id": "this", "delta": 1e-5, "epsilon_per_client": understated}}
    (run / "summary.json").write_text(json.dumps(summary))
    expected = lifetime.epsilons(1e-5)
    assert all(expected[cid] > this_run.epsilons(1e-5)[cid] > 0.5 for cid in this_run)
    found, source, warnings = read_lifetime(run, 1e-5)
    assert source == "node-ledgers.json (recomputed)" and found["earlier_runs"] == ["earlier"]
    assert found["epsilon_per_client"] == {**{str(c): pytest.approx(e) for c, e in expected.items()}, client: 1e6}
    assert len(warnings) == len(this_run) and f"client {client}: summary.json states lifetime epsilon 1e+06" in \
        "\n".join(warnings)
    assert main(["ledger", str(run)]) == 0
    captured = capsys.readouterr()
    assert "lifetime: every release of the client on its node, this run's and earlier runs' (earlier); from " \
           "node-ledgers.json (recomputed)" in captured.out
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines() if line.split()[:1] in
            [[str(c)] for c in this_run]}
    other = next(str(c) for c in this_run if str(c) != client)
    assert float(rows[other][3]) == pytest.approx(expected[int(other)], rel=1e-2)
    assert rows[client][3] == format_epsilon(1e6)
    # at another delta: recomputed there (the summary holds only the run's delta, so nothing to compare)
    assert main(["ledger", str(run), "--delta", "1e-3"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == [other])
    assert float(row[3]) == pytest.approx(lifetime.epsilons(1e-3)[int(other)], rel=1e-2)
    # a run written before node ledgers were kept: the summary's figures, and the source says so
    (run / "node-ledgers.json").unlink()
    assert read_lifetime(run, 1e-5)[1] == "summary.json (not recomputed: the run saved no node-ledgers.json), at " \
                                          "delta=1e-05"


def _table_row(table, first):
    """The header and the row starting with ``first`` of a fixed-width table, as {column: cell}."""
    import re

    lines = table.splitlines()
    header = re.split(r"\s{2,}", lines[0].strip())
    row = next(re.split(r"\s{2,}", line.strip()) for line in lines[2:] if line.startswith(first))
    return dict(zip(header, row, strict=False))


def test_report_and_ledger_show_each_epsilon_with_its_relation_trust_model_and_ledger_source(runs, tmp_path,
                                                                                            capsys):
    import shutil

    from privfl.evaluation.report import format_epsilon

    run = tmp_path / "finished"
    shutil.copytree(runs / "finished", run)
    summary = json.loads((run / "summary.json").read_text())
    summary["privacy"]["epsilon_max_training"] = 0.001          # a summary edited after the run: not what is shown
    (run / "summary.json").write_text(json.dumps(summary))
    spent = max(read_spend(run).epsilons().values())
    assert main(["report", str(run)]) == 0
    row = _table_row(capsys.readouterr().out, "fedavg")
    assert row["eps train"] == format_epsilon(spent) != format_epsilon(0.001)
    assert (row["relation"], row["trust"], row["eps from"]) == (
        "add_or_remove_one", "untrusted server", "releases.jsonl + ledger.json (recomputed)")
    # an unfinished run: recomputed from its journal and checkpoint
    assert main(["report", str(runs / "unfinished")]) == 0
    row = _table_row(capsys.readouterr().out, "fedavg")
    assert (row["relation"], row["trust"], row["eps from"]) == (
        "add_or_remove_one", "untrusted server", "releases.jsonl + checkpoint.pt (recomputed)")
    # privfl ledger: per client, the relation and whom the epsilon holds against; the files it recomputed from
    assert main(["ledger", str(run)]) == 0
    out = capsys.readouterr().out
    assert "recomputed from releases.jsonl, ledger.json" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("client "))
    first = str(next(iter(read_spend(run).book))).rjust(6)
    client = _table_row("\n".join([lines[header], "-", *lines[header + 1:]]), first)
    assert (client["relation"], client["trust"]) == ("add_or_remove_one", "untrusted server")
