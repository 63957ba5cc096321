"""The release journal's hash chain, its position, the checks a resumed run makes with it, and marks."""

import json

import pytest

from accounting import GaussianEvent, JournalDamaged, JournalMismatch, JournalPosition, LedgerBook, ReleaseJournal
from accounting.journal import GENESIS, SHORT_HASH, line_hash

EVENT = GaussianEvent(5.0)


def _chained(entries):
    """``entries`` as the lines of a compact journal, each carrying the short hash of the line before (what a writer
    that knows the format produces)."""
    previous, text = GENESIS, ""
    for entry in entries:
        line = json.dumps({**entry, "p": previous[:SHORT_HASH]})
        text += line + "\n"
        previous = line_hash(line.encode())
    return text


def _journal(tmp_path, releases=3):
    journal, book = ReleaseJournal(tmp_path / "releases.jsonl"), LedgerBook()
    for i in range(releases):
        journal.append(i % 2, book[i % 2].record(EVENT, purpose="descriptor", round=i))
    return journal, book


def test_each_line_carries_the_hash_of_the_line_before_and_the_position_names_the_last(tmp_path):
    journal, _ = _journal(tmp_path)
    lines = (tmp_path / "releases.jsonl").read_bytes().split(b"\n")[:-1]
    prevs = [json.loads(line)["p"] for line in lines]
    assert prevs == [h[:SHORT_HASH] for h in (GENESIS, line_hash(lines[0]), line_hash(lines[1]))]
    assert journal.position() == JournalPosition(3, line_hash(lines[2]))
    assert ReleaseJournal(tmp_path / "absent.jsonl").position() == JournalPosition(0, GENESIS)
    # a second object on the same file continues the chain where the file ends
    again = ReleaseJournal(tmp_path / "releases.jsonl")
    again.mark("novel_clients_served", releases=0)
    assert json.loads((tmp_path / "releases.jsonl").read_text().splitlines()[3])["p"] == line_hash(lines[2])[:16]
    assert again.marks() == [{"mark": "novel_clients_served", "releases": 0}]
    assert len(again.entries()) == 3      # marks are not releases


@pytest.mark.parametrize("edit", ["change", "remove", "swap"])
def test_an_edited_removed_or_reordered_line_is_named(tmp_path, edit):
    journal, _ = _journal(tmp_path, releases=4)
    path = tmp_path / "releases.jsonl"
    lines = path.read_text().splitlines()
    if edit == "change":
        lines[1] = lines[1].replace('"sigma":5.0', '"sigma":50.0')
    elif edit == "remove":
        del lines[1]
    else:
        lines[1], lines[2] = lines[2], lines[1]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(JournalDamaged, match="line [23] does not follow line [12]"):
        journal.entries()


def test_verify_refuses_a_journal_shorter_than_or_different_from_the_one_the_checkpoint_saw(tmp_path):
    journal, book = _journal(tmp_path)
    seen = journal.position()
    journal.append(0, book[0].record(EVENT, purpose="descriptor", round=3))
    journal.verify(seen)                                   # longer is what a kill after the checkpoint leaves
    path = tmp_path / "releases.jsonl"
    kept = path.read_text().splitlines()
    path.write_text("\n".join(kept[:2]) + "\n")            # cut below what the checkpoint saw
    with pytest.raises(JournalMismatch, match="holds 2 lines, but the checkpoint was saved when it held 3"):
        journal.verify(seen)
    path.write_text("")                                    # emptied
    with pytest.raises(JournalMismatch, match="holds 0 lines"):
        journal.verify(seen)
    (tmp_path / "other").mkdir()
    _journal(tmp_path / "other", releases=4)
    path.write_bytes((tmp_path / "other" / "releases.jsonl").read_bytes())   # another run's journal
    with pytest.raises(JournalMismatch, match="differs from the one the checkpoint saw"):
        journal.verify(seen)


def test_a_line_cut_short_is_ignored_when_read_and_removed_by_repair_before_appending(tmp_path):
    journal, book = _journal(tmp_path)
    path = tmp_path / "releases.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"prev": "ab", "client_id": 1, "rec')
    fresh = ReleaseJournal(path)
    assert len(fresh.entries()) == 3 and fresh.position() == journal.position()
    with pytest.raises(JournalDamaged, match="cut short"):
        fresh.append(1, book[1].record(EVENT, purpose="descriptor", round=9))
    assert fresh.repair() == len(b'{"prev": "ab", "client_id": 1, "rec') and path.read_bytes() == whole
    fresh.append(1, book[1].record(EVENT, purpose="descriptor", round=9))
    assert len(fresh.entries()) == 4 and fresh.repair() == 0


def test_a_line_that_is_not_json_or_not_a_release_is_named_with_its_number(tmp_path):
    path = tmp_path / "releases.jsonl"
    _journal(tmp_path)
    path.write_text(path.read_text() + "not json\n")
    with pytest.raises(JournalDamaged, match="line 4 is not JSON"):
        ReleaseJournal(path).entries()
    lines = path.read_text().splitlines()[:3]
    entry = json.loads(lines[2])
    entry["r"]["event"]["sigma"] = -1.0
    path.write_text("\n".join(lines[:2] + [json.dumps(entry)]) + "\n")
    with pytest.raises(JournalDamaged, match="line 3 is not a release record"):
        ReleaseJournal(path).entries()


def test_a_release_like_an_earlier_one_names_its_line_and_reads_back_as_recorded(tmp_path):
    journal, book = ReleaseJournal(tmp_path / "releases.jsonl"), LedgerBook()
    made = [(cid, book[cid].record(EVENT, purpose="model_update", round=0, metadata={"clip": 1.0}))
            for cid in (3, 1, 4, 1, 5)]
    for cid, record in made:
        journal.append(cid, record)
    everyone = book.record_for([1, 3, 4, 5], GaussianEvent(2.0), purpose="central_aggregate", round=0)
    journal.append_for([1, 3, 4, 5], everyone)
    again = book.record_for([1, 3, 4, 5], GaussianEvent(2.0), purpose="central_aggregate", round=1)
    journal.append_for([1, 3, 4, 5], again)
    lines = [json.loads(line) for line in (tmp_path / "releases.jsonl").read_text().splitlines()]
    assert "r" in lines[0] and all(line.get("s") == 1 and "r" not in line for line in lines[1:5])
    assert lines[5]["cs"] == [1, 3, 4, 5] and lines[6]["cl"] == 6 and "r" in lines[6]   # round 1: a new record
    assert journal.entries() == [*made, *[(c, everyone) for c in (1, 3, 4, 5)], *[(c, again) for c in (1, 3, 4, 5)]]
    replayed = LedgerBook()
    assert journal.replay_into(replayed) == 13 and replayed.state_dict() == book.state_dict()
    # a line naming a line that holds no record (or a later one) is damage, named with its number
    lines[2]["s"] = 3
    (tmp_path / "bad.jsonl").write_text(_chained(lines))
    with pytest.raises(JournalDamaged, match="line 3 is not a release record"):
        ReleaseJournal(tmp_path / "bad.jsonl").entries()


def test_a_thousand_releases_of_one_round_take_a_short_line_each(tmp_path):
    """What a round of central DP writes: one line per client of at most 80 bytes (the record once, then its line
    number, the client and the time), and the round's release for everyone once with its client list named after
    the first round."""
    journal, book = ReleaseJournal(tmp_path / "releases.jsonl"), LedgerBook()
    from accounting import NonPrivateEvent

    ids = list(range(1000))
    for round in range(2):
        for cid in ids:
            journal.append(cid, book[cid].record(NonPrivateEvent(), purpose="model_update", round=round,
                                                 metadata={"mode": "central", "bytes": 796840},
                                                 audience="trusted_aggregator"))
        journal.append_for(ids, book.record_for(ids, GaussianEvent(2.0), purpose="central_aggregate", round=round))
    lines = (tmp_path / "releases.jsonl").read_bytes().splitlines()
    full = len(json.dumps(book[0].records[0].to_dict()))
    assert len(lines) == 2002 and sum(len(line) > 80 for line in lines) == 4        # 2 records, 2 for everyone
    assert len(lines[1001]) < 20 + 4 * len(ids) + full + 80 and len(lines[2001]) < full + 80    # ids once
    assert len(journal.entries()) == 4000


def test_a_journal_of_the_first_format_is_read_and_continued_in_it(tmp_path):
    """Journals written before lines were compact (``"prev"``: the whole hash, every record in full)."""
    book, path = LedgerBook(), tmp_path / "releases.jsonl"
    records = [book[0].record(EVENT, purpose="descriptor", round=r) for r in range(2)]
    previous, text = GENESIS, ""
    for record in records:
        line = json.dumps({"prev": previous, "client_id": 0, "record": record.to_dict()})
        text += line + "\n"
        previous = line_hash(line.encode())
    path.write_text(text)
    journal = ReleaseJournal(path)
    later = book[0].record(EVENT, purpose="descriptor", round=1)
    journal.append(0, later)
    journal.mark("novel_clients_served", releases=0)
    last = [json.loads(line) for line in path.read_text().splitlines()[2:]]
    assert last[0]["prev"] == previous and last[0]["record"] == later.to_dict() and "prev" in last[1]
    assert [r for _, r in ReleaseJournal(path).entries()] == [*records, later]
    assert ReleaseJournal(path).marks() == [{"mark": "novel_clients_served", "releases": 0}]


def test_a_journal_replaced_under_the_writer_is_read_again_before_the_next_line(tmp_path):
    """The writer keeps its file open between lines; a file removed or cut by someone else is never written blind
    (into a file no path names, or after a chain that is no longer there)."""
    journal, book = _journal(tmp_path)
    path = tmp_path / "releases.jsonl"
    kept = path.read_bytes()
    path.unlink()
    journal.append(0, book[0].record(EVENT, purpose="descriptor", round=5))
    assert len(ReleaseJournal(path).entries()) == 1 and json.loads(path.read_text())["p"] == GENESIS[:SHORT_HASH]
    path.write_bytes(kept)
    journal.append(0, book[0].record(EVENT, purpose="descriptor", round=6))
    assert len(ReleaseJournal(path).entries()) == 4 and journal.position() == ReleaseJournal(path).position()
