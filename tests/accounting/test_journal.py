"""The release journal's hash chain, its position, the checks a resumed run makes with it, and marks."""

import json

import pytest

from accounting import GaussianEvent, JournalDamaged, JournalMismatch, JournalPosition, LedgerBook, ReleaseJournal
from accounting.journal import GENESIS, line_hash

EVENT = GaussianEvent(5.0)


def _journal(tmp_path, releases=3):
    journal, book = ReleaseJournal(tmp_path / "releases.jsonl"), LedgerBook()
    for i in range(releases):
        journal.append(i % 2, book[i % 2].record(EVENT, purpose="descriptor", round=i))
    return journal, book


def test_each_line_carries_the_hash_of_the_line_before_and_the_position_names_the_last(tmp_path):
    journal, _ = _journal(tmp_path)
    lines = (tmp_path / "releases.jsonl").read_bytes().split(b"\n")[:-1]
    prevs = [json.loads(line)["prev"] for line in lines]
    assert prevs == [GENESIS, line_hash(lines[0]), line_hash(lines[1])]
    assert journal.position() == JournalPosition(3, line_hash(lines[2]))
    assert ReleaseJournal(tmp_path / "absent.jsonl").position() == JournalPosition(0, GENESIS)
    # a second object on the same file continues the chain where the file ends
    again = ReleaseJournal(tmp_path / "releases.jsonl")
    again.mark("novel_clients_served", releases=0)
    assert json.loads((tmp_path / "releases.jsonl").read_text().splitlines()[3])["prev"] == line_hash(lines[2])
    assert again.marks() == [{"mark": "novel_clients_served", "releases": 0}]
    assert len(again.entries()) == 3      # marks are not releases


@pytest.mark.parametrize("edit", ["change", "remove", "swap"])
def test_an_edited_removed_or_reordered_line_is_named(tmp_path, edit):
    journal, _ = _journal(tmp_path, releases=4)
    path = tmp_path / "releases.jsonl"
    lines = path.read_text().splitlines()
    if edit == "change":
        lines[1] = lines[1].replace('"sigma": 5.0', '"sigma": 50.0')
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
    entry["record"]["event"]["sigma"] = -1.0
    path.write_text("\n".join(lines[:2] + [json.dumps(entry)]) + "\n")
    with pytest.raises(JournalDamaged, match="line 3 is not a release record"):
        ReleaseJournal(path).entries()
