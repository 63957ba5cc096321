"""Ledgers: refusal before recording, monotone epsilon, JSON state, atomic saves, and the book of all clients."""

import json
import math
import os
import pickle

import pytest

import accounting.ledger
from accounting import (
    BudgetExceededError,
    ComposedEvent,
    GaussianEvent,
    LaplaceEvent,
    LedgerBook,
    NonPrivateEvent,
    PrivacyBudget,
    PrivacyLedger,
    ReleaseRecord,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    UnsupportedAccountingError,
    analytic_gaussian_sigma,
    epsilon,
)

DELTA = 1e-5
BUDGET = PrivacyBudget(epsilon=1.0, delta=DELTA)
DESCRIPTOR = GaussianEvent(5.0)  # about 0.73 at delta = 1e-5: one fits in BUDGET, two do not
ROUND_OF_DP_SGD = SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.01), 20)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PrivacyBudget(0.0, DELTA), "budget epsilon must be a finite number > 0, got 0.0"),
        (lambda: PrivacyBudget(math.inf, DELTA), "budget epsilon must be a finite number > 0, got inf"),
        (lambda: PrivacyBudget(1.0, 1.0), "budget delta must be a probability in (0, 1), got 1.0"),
        (lambda: PrivacyLedger(1.5), "client_id must be an int or a str, got 1.5"),
        (lambda: PrivacyLedger(True), "client_id must be an int or a str, got True"),
        (lambda: PrivacyLedger(1, budget=(1.0, DELTA)), "budget must be a PrivacyBudget or None, got (1.0, 1e-05)"),
        (lambda: PrivacyLedger(1, accountant="moments"),
         "accountant must be one of 'pld', 'rdp', 'prv', got 'moments'"),
        (lambda: PrivacyLedger(1).record(DESCRIPTOR, purpose=""), "purpose must be a non-empty str, got ''"),
        (lambda: PrivacyLedger(1).record(DESCRIPTOR, purpose="x", round=-1),
         "round must be None or an integer >= 0, got -1"),
        (lambda: PrivacyLedger(1).record("noise", purpose="x"),
         "event must be an accounting PrivacyEvent, got 'noise'"),
        (lambda: PrivacyLedger(1).record(ComposedEvent(()), purpose="x"),
         "client 1: ComposedEvent(events=()) composes no mechanism, so it would be recorded at epsilon 0"),
        (lambda: PrivacyLedger(1, budget=BUDGET).would_exceed(ComposedEvent(())),
         "ComposedEvent(events=()) composes no mechanism"),
        (lambda: PrivacyLedger(1).spent(), "client 1: give a delta; the ledger has no budget to take it from"),
        (lambda: PrivacyLedger(1).spent(2.0), "delta must be a probability in (0, 1), got 2.0"),
        (lambda: PrivacyLedger(1).would_exceed(DESCRIPTOR), "client 1: give a PrivacyBudget; the ledger has none"),
    ],
)
def test_bad_inputs_name_the_value(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value)


@pytest.mark.parametrize(("budget_epsilon", "releases"), [(1.0, 1), (4.0, 1), (8.0, 1), (1.0, 5), (4.0, 100)])
def test_a_budget_admits_releases_calibrated_to_it_exactly(budget_epsilon, releases):
    # Noise calibrated so that `releases` Gaussian releases of sensitivity 1 compose to exactly the budget: k of them
    # are one Gaussian of sensitivity sqrt(k) (client-level DP calibrates so). The accountant prices them up to
    # ~1e-11 above the budget; a strict comparison refused the last of them.
    event = GaussianEvent(analytic_gaussian_sigma(budget_epsilon, DELTA, math.sqrt(releases)))
    ledger = PrivacyLedger("bob", budget=PrivacyBudget(budget_epsilon, DELTA))
    for r in range(releases):
        ledger.record(event, purpose="update", round=r)
    assert ledger.spent().epsilon == pytest.approx(budget_epsilon, rel=1e-9)
    # Nothing is left: a further release, even at sigma 50, is refused and nothing is recorded.
    with pytest.raises(BudgetExceededError):
        ledger.record(GaussianEvent(50.0), purpose="update", round=releases)
    assert len(ledger) == releases


def test_a_budget_refuses_an_excess_above_the_accountants_precision():
    # 1e-5 relative above the budget: more than the accountant's numerical slack (BUDGET_RTOL), so refused.
    budget = PrivacyBudget(1.0, DELTA)
    assert budget.allows(1.0) and budget.allows(1.0 + 1e-7) and not budget.allows(1.0 + 1e-5)
    assert not budget.allows(math.inf) and not budget.allows(math.nan)
    over = GaussianEvent(analytic_gaussian_sigma(1.0 + 1e-5, DELTA))
    assert PrivacyLedger("bob", budget=budget).would_exceed(over)
    with pytest.raises(BudgetExceededError):
        PrivacyLedger("bob", budget=budget).record(over, purpose="descriptor")


def test_budget_refuses_before_anything_is_recorded():
    ledger = PrivacyLedger("alice", budget=BUDGET)
    ledger.record(DESCRIPTOR, purpose="descriptor", round=0)
    state_before, spent_before = ledger.state_dict(), ledger.spent()
    assert ledger.would_exceed(DESCRIPTOR)

    with pytest.raises(BudgetExceededError) as info:
        ledger.record(DESCRIPTOR, purpose="descriptor", round=1)

    assert len(ledger) == 1
    assert ledger.state_dict() == state_before
    assert ledger.spent() == spent_before
    message = str(info.value)
    assert "client 'alice'" in message and "'descriptor'" in message
    assert f"from {spent_before.epsilon:.4f} to" in message
    assert "over the budget epsilon=1, delta=1e-05; nothing was recorded" in message
    assert info.value.epsilon_after > BUDGET.epsilon


def test_budget_exceeded_error_survives_pickling():
    error = BudgetExceededError(3, "update", 0.5, 1.5, BUDGET, "pld")
    restored = pickle.loads(pickle.dumps(error))
    assert str(restored) == str(error) and restored.client_id == 3


def test_a_non_private_release_exceeds_every_budget_and_makes_epsilon_infinite():
    generous = PrivacyLedger(0, budget=PrivacyBudget(epsilon=1e6, delta=0.5))
    assert generous.would_exceed(NonPrivateEvent())
    with pytest.raises(BudgetExceededError, match="to inf"):
        generous.record(NonPrivateEvent(), purpose="raw_features")
    assert len(generous) == 0

    unbudgeted = PrivacyLedger(0)
    unbudgeted.record(DESCRIPTOR, purpose="descriptor")
    unbudgeted.record(NonPrivateEvent(), purpose="raw_features")
    assert unbudgeted.spent(DELTA).epsilon == math.inf


def test_would_exceed_records_nothing_and_accepts_another_budget():
    ledger = PrivacyLedger(1, budget=BUDGET)
    assert not ledger.would_exceed(DESCRIPTOR)
    assert ledger.would_exceed(DESCRIPTOR, PrivacyBudget(epsilon=0.5, delta=DELTA))
    assert len(ledger) == 0 and ledger.spent().epsilon == 0.0


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_epsilon_only_grows_and_matches_the_accountant(accountant):
    ledger = PrivacyLedger(1, accountant=accountant)
    epsilons = [ledger.spent(DELTA).epsilon]
    for round_ in range(4):
        ledger.record(ROUND_OF_DP_SGD, purpose="model_update", round=round_)
        epsilons.append(ledger.spent(DELTA).epsilon)
    assert all(a < b for a, b in zip(epsilons, epsilons[1:]))
    assert epsilons[-1] == pytest.approx(epsilon(ComposedEvent(ledger.events), DELTA, accountant=accountant))
    assert ledger.spent(DELTA).num_releases == 4 * 20


def test_releases_under_another_relation_are_refused():
    ledger = PrivacyLedger(1)
    ledger.record(GaussianEvent(2.0, relation="replace_one"), purpose="descriptor")
    with pytest.raises(ValueError, match="holds releases under relation 'replace_one', cannot record one under "
                                         "'add_or_remove_one'"):
        ledger.record(ROUND_OF_DP_SGD, purpose="model_update")
    assert len(ledger) == 1


def test_releases_the_accountant_cannot_price_are_refused_even_without_a_budget():
    ledger = PrivacyLedger(1, accountant="prv")
    with pytest.raises(UnsupportedAccountingError, match="LaplaceEvent"):
        ledger.record(LaplaceEvent(1.0), purpose="counts")
    assert len(ledger) == 0


def test_metadata_must_be_json_able():
    ledger = PrivacyLedger(1)
    with pytest.raises(ValueError, match="metadata of release 'update' must be JSON-able"):
        ledger.record(DESCRIPTOR, purpose="update", metadata={"tensor": object()})
    with pytest.raises(ValueError, match="metadata of release 'update' must be JSON-able"):
        ledger.record(DESCRIPTOR, purpose="update", metadata={"loss": math.nan})
    assert len(ledger) == 0


def test_views_are_read_only_copies():
    ledger = PrivacyLedger(1)
    record = ledger.record(DESCRIPTOR, purpose="descriptor", round=4, metadata={"bytes": 128})
    assert ledger.records == (record,) and ledger.events == (DESCRIPTOR,)
    assert isinstance(ledger.records, tuple) and isinstance(ledger.events, tuple)
    assert record.round == 4 and record.metadata == {"bytes": 128} and record.time > 1.6e9


def test_release_record_round_trip():
    record = ReleaseRecord(ROUND_OF_DP_SGD, "model_update", 3, 1.7e9, {"bytes": 10, "names": ["w", "b"]})
    assert ReleaseRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


@pytest.mark.parametrize("client_id", [7, "7", "client-a"])
def test_state_dict_round_trips_through_json(client_id):
    ledger = PrivacyLedger(client_id, budget=BUDGET, accountant="rdp")
    ledger.record(DESCRIPTOR, purpose="descriptor", round=0, metadata={"bytes": 40})
    restored = PrivacyLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.client_id == client_id and type(restored.client_id) is type(client_id)
    assert restored.records == ledger.records
    assert restored.budget == BUDGET and restored.accountant == "rdp"
    assert restored.spent() == ledger.spent()

    other = PrivacyLedger(client_id)
    other.load_state_dict(ledger.state_dict())
    assert other.records == ledger.records and other.budget == BUDGET


def test_load_state_dict_refuses_another_clients_state():
    state = PrivacyLedger(7).state_dict()
    with pytest.raises(ValueError, match="state belongs to client 7, not to client '7'"):
        PrivacyLedger("7").load_state_dict(state)
    with pytest.raises(ValueError, match="expected a state with format 'privfl.accounting.ledger'"):
        PrivacyLedger.from_state_dict({"format": "something else"})


def test_save_and_load(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(2, budget=BUDGET)
    ledger.record(DESCRIPTOR, purpose="descriptor", round=0)
    ledger.save(path)
    loaded = PrivacyLedger.load(path)
    assert loaded.records == ledger.records and loaded.spent() == ledger.spent()
    assert os.listdir(tmp_path) == ["ledger.json"]


def _crash_after_writing(fd):
    # the new content is in the temporary file (not yet synced or renamed) when the process "dies"
    raise KeyboardInterrupt("crash mid-write")


@pytest.mark.parametrize(
    ("target", "crash"),
    [
        ("os.replace", lambda *args: (_ for _ in ()).throw(OSError("crash before rename"))),
        ("os.fsync", _crash_after_writing),
    ],
    ids=["replace", "write"],
)
def test_a_crash_mid_save_leaves_the_previous_file_intact(tmp_path, monkeypatch, target, crash):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(2)
    ledger.record(DESCRIPTOR, purpose="descriptor", round=0)
    ledger.save(path)
    ledger.record(DESCRIPTOR, purpose="descriptor", round=1)

    monkeypatch.setattr(target, crash)
    with pytest.raises((OSError, KeyboardInterrupt)):
        ledger.save(path)
    monkeypatch.undo()

    previous = PrivacyLedger.load(path)
    assert len(previous) == 1 and previous.records == ledger.records[:1]
    assert os.listdir(tmp_path) == ["ledger.json"]  # no temporary file left behind


def test_accounting_is_cached_between_records(monkeypatch):
    calls = []

    def counting_epsilon(*args, **kwargs):
        calls.append(args)
        return epsilon(*args, **kwargs)

    monkeypatch.setattr(accounting.ledger, "epsilon", counting_epsilon)
    ledger = PrivacyLedger(1, budget=BUDGET)
    assert not ledger.would_exceed(DESCRIPTOR)
    ledger.record(DESCRIPTOR, purpose="descriptor")  # reuses the projection would_exceed computed
    ledger.spent()  # reuses what record computed
    assert len(calls) == 1


def test_ledger_book_creates_ledgers_on_first_use():
    book = LedgerBook(default_budget=BUDGET)
    assert 3 not in book and book.get(3) is None and len(book) == 0
    book[3].record(DESCRIPTOR, purpose="descriptor")
    assert 3 in book and book[3].budget == BUDGET and list(book) == [3]
    with pytest.raises(ValueError, match="client 3 already has a ledger"):
        book.add(PrivacyLedger(3))
    with pytest.raises(ValueError, match="client_id must be an int or a str, got 2.5"):
        book[2.5]
    assert LedgerBook()[0].budget is None


def test_ledger_book_lists_the_relations_its_guarantees_hold_under(tmp_path):
    book = LedgerBook()
    assert book.relations() == []
    book[0].record(NonPrivateEvent(), purpose="model_update")             # no guarantee, no relation
    assert book.relations() == []
    book[1].record(DESCRIPTOR, purpose="descriptor", metadata={"relation": "replace one sample; n public"})
    book[2].record(DESCRIPTOR, purpose="descriptor", metadata={"relation": "replace one sample; n public"})
    book[2].record(DESCRIPTOR, purpose="descriptor")                      # no words: the event's relation
    book[3].record(DESCRIPTOR, purpose="gmm", metadata={"relation": "replace_one within the public class histogram"})
    expected = ["replace one sample; n public", "replace_one", "replace_one within the public class histogram"]
    assert book.relations() == expected
    book.save(tmp_path / "book.json")
    assert LedgerBook.load(tmp_path / "book.json").relations() == expected


def test_ledger_book_keeps_int_and_str_client_ids_apart_through_save_and_load(tmp_path):
    book = LedgerBook(default_budget=BUDGET, accountant="rdp")
    book[1].record(DESCRIPTOR, purpose="descriptor")
    book["1"].record(GaussianEvent(10.0), purpose="descriptor")
    book.add(PrivacyLedger("dave", accountant="rdp")).record(NonPrivateEvent(), purpose="raw")
    path = tmp_path / "ledgers.json"
    book.save(path)

    loaded = LedgerBook.load(path)
    assert set(loaded) == {1, "1", "dave"}
    assert loaded.epsilons(DELTA) == book.epsilons(DELTA)
    assert loaded.epsilons(DELTA)["dave"] == math.inf
    assert loaded.epsilons(DELTA)[1] > loaded.epsilons(DELTA)["1"]
    assert loaded.default_budget == BUDGET and loaded.accountant == "rdp"

    other = LedgerBook()
    other.load_state_dict(book.state_dict())
    assert set(other) == {1, "1", "dave"} and other[1].records == book[1].records


def test_ledger_book_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ledgers.json"
    book = LedgerBook()
    book[0].record(DESCRIPTOR, purpose="descriptor")
    book.save(path)
    book[1].record(DESCRIPTOR, purpose="descriptor")
    monkeypatch.setattr("os.fsync", _crash_after_writing)
    with pytest.raises(KeyboardInterrupt):
        book.save(path)
    monkeypatch.undo()
    assert set(LedgerBook.load(path)) == {0}
    assert os.listdir(tmp_path) == ["ledgers.json"]


def test_release_journal_replays_what_a_saved_book_lacks_and_ignores_a_line_cut_short(tmp_path):
    path = tmp_path / "releases.jsonl"
    journal, book = accounting.ReleaseJournal(path), LedgerBook()
    assert journal.entries() == [] and journal.replay_into(LedgerBook()) == 0        # no file yet: nothing
    journal.append(1, book[1].record(DESCRIPTOR, purpose="descriptor", round=0, metadata={"bytes": 8}))
    saved = LedgerBook.from_state_dict(book.state_dict())                            # the checkpoint's book
    journal.append("a", book["a"].record(DESCRIPTOR, purpose="descriptor", round=1))
    journal.append(1, book[1].record(GaussianEvent(7.0), purpose="model_update", round=1))
    with open(path, "a") as f:
        f.write('{"client_id": 1, "record": {"event"')                              # killed mid-line: not sent
    assert [cid for cid, _ in journal.entries()] == [1, "a", 1]
    assert journal.replay_into(saved) == 2 and saved.state_dict() == book.state_dict()
    assert journal.replay_into(saved) == 0                                            # already there: idempotent
    other = LedgerBook()
    other[1].record(GaussianEvent(9.0), purpose="descriptor", round=0)               # another run's ledger
    with pytest.raises(ValueError, match="does not match the ledger of client 1 at its record 0"):
        journal.replay_into(other)


def test_a_release_made_for_many_clients_is_one_record_in_the_book_and_the_journal(tmp_path):
    # central DP records the round's aggregate in every training client's ledger: one record object, written once
    from accounting import ReleaseJournal, SubsampledGaussianEvent

    book = LedgerBook()
    book[2].record(NonPrivateEvent(), purpose="contribution", audience="trusted_aggregator")
    event = SubsampledGaussianEvent(1.2, 0.1)
    journal = ReleaseJournal(tmp_path / "releases.jsonl")
    for round_index in range(3):
        journal.append_for([1, 2, 3], book.record_for([1, 2, 3], event, purpose="central_aggregate",
                                                       round=round_index))
    assert all(len(book[c].records) == 3 + (c == 2) for c in (1, 2, 3))
    assert book[1].records[0] is book[3].records[0]
    state = book.state_dict()
    assert len(state["records"]) == 4 and len(state["kinds"]) == 2      # the contribution, then a round each
    assert [entry["records"] for entry in state["ledgers"]] == [[0, 1, 2, 3], [1, 2, 3], [1, 2, 3]]
    back = LedgerBook.from_state_dict(json.loads(json.dumps(state)))
    assert back.epsilons(1e-5) == book.epsilons(1e-5)
    assert back[1].records == book[1].records and back[2].records == book[2].records
    assert len(tmp_path.joinpath("releases.jsonl").read_text().splitlines()) == 3     # one line a round
    replayed = LedgerBook()
    assert journal.replay_into(replayed) == 9
    assert replayed.epsilons(1e-5) == pytest.approx({1: book.epsilons(1e-5)[1], 2: book.epsilons(1e-5)[2],
                                                     3: book.epsilons(1e-5)[3]})
    # over a client's budget: refused before any ledger records it
    book[3]._budget = PrivacyBudget(epsilon=book[3].spent(1e-5).epsilon * 1.01, delta=1e-5)
    with pytest.raises(BudgetExceededError):
        book.record_for([1, 2, 3], event, purpose="central_aggregate", round=3)
    assert all(len(book[c].records) == 3 + (c == 2) for c in (1, 2, 3))


def test_a_book_saved_in_the_first_layout_loads_as_it_was():
    """Books written before the compact layout (version 1: every record in full, one made for many clients under
    "shared") load unchanged: ledger.json files and checkpoints of earlier runs."""
    from accounting import SubsampledGaussianEvent

    own = {"event": NonPrivateEvent().to_dict(), "purpose": "contribution", "round": 0, "time": 1.5,
           "metadata": {"bytes": 40}, "audience": "trusted_aggregator"}
    shared = {"event": SubsampledGaussianEvent(1.2, 0.1).to_dict(), "purpose": "central_aggregate", "round": 1,
              "time": 2.5, "metadata": {}}
    state = {"format": "privfl.accounting.ledger_book", "version": 1, "default_budget": None, "accountant": "pld",
             "shared": [shared],
             "ledgers": [{"format": "privfl.accounting.ledger", "version": 1, "client_id": cid, "budget": None,
                          "accountant": "pld", "records": records}
                         for cid, records in ((1, [own, {"shared": 0}]), ("b", [{"shared": 0}]))]}
    book = LedgerBook.from_state_dict(json.loads(json.dumps(state)))
    assert [r.to_dict() for r in book[1].records] == [own, shared] and book[1].records[1] is book["b"].records[0]
    again = LedgerBook.from_state_dict(json.loads(json.dumps(book.state_dict())))       # saved compact, loaded
    assert again.state_dict() == book.state_dict() and again["b"].records == book["b"].records
    assert book.state_dict()["version"] == 2


def test_a_round_release_for_everyone_prices_few_compositions_and_refuses_exactly(monkeypatch):
    """Central DP records its aggregate for every client each round: the book prices a larger composition ahead
    (the run's plan when given, else twice the projection) and approves the rounds it holds, so R rounds price
    about 2 log2 R compositions, or one with the plan; the release past the budget is still refused, with the
    projection's own epsilon."""
    from collections import Counter

    from accounting import SubsampledGaussianEvent

    event, rounds = SubsampledGaussianEvent(1.0, 0.5), 16
    exact = LedgerBook()[0]
    for r in range(rounds):
        exact.record(event, purpose="central_aggregate", round=r)
    budget = PrivacyBudget(epsilon=exact.spent(1e-5).epsilon, delta=1e-5)   # exactly 16 rounds fit
    priced = []
    original = PrivacyLedger._epsilon_of
    monkeypatch.setattr(PrivacyLedger, "_epsilon_of", lambda self, leaves, delta: (
        priced.append(sum(leaves.values())), original(self, leaves, delta))[1])
    for planned in (None, rounds):
        priced.clear()
        book = LedgerBook()
        for r in range(rounds):
            book.record_for([0, 1, 2], event, purpose="central_aggregate", round=r, calibrated_for=budget,
                            planned=planned)
        # with the plan: 16 once; without: 2, 6, 14, then 30, 22 and 18 over the budget, then 16 (and the exact
        # projections of no round: each is held by a composition priced within the budget)
        assert len(priced) == 1 if planned else len(priced) <= 2 * math.ceil(math.log2(rounds)), priced
        with pytest.raises(BudgetExceededError) as refused:
            book.record_for([0, 1, 2], event, purpose="central_aggregate", round=rounds, calibrated_for=budget,
                            planned=planned)
        assert refused.value.epsilon_after == pytest.approx(LedgerBook()[0]._epsilon_of(
            Counter({event: rounds + 1}), 1e-5))
        assert all(len(book[c]) == rounds for c in (0, 1, 2))
