"""A resumed run checks its release journal against its checkpoint, and never serves novel clients twice."""

import json

import pytest
import torch

from accounting import ReleaseJournal
from privfl.errors import ConfigError
from privfl.experiment import RunInterrupted, train
from privfl.federation import RunDirectory
from privfl.privacy.training import NovelPrivacy, TrainingPrivacy


def _stopped_between_checkpoints(config, out):
    """The run's state after a kill in round 3 (checkpoint after round 2; round 3's releases journaled)."""
    with pytest.raises(RunInterrupted):
        train(config, out, progress=False, stop_after_round=3)
    journal = ReleaseJournal(f"{out}/releases.jsonl")
    checkpoint = torch.load(f"{out}/checkpoint.pt", weights_only=True)
    assert checkpoint["journal"] == journal.position().to_dict() and checkpoint["format"] == 2
    return journal


@pytest.mark.parametrize("damage", ["emptied", "cut", "another_run", "edited"])
def test_resume_refuses_a_journal_shorter_than_or_different_from_what_its_checkpoint_saw(tmp_path, tiny_config,
                                                                                        damage):
    out = str(tmp_path / "run")
    journal = _stopped_between_checkpoints(tiny_config(), out)
    lines = journal.path.read_text().splitlines()
    if damage == "emptied":       # the case: resumed, it reported 600 releases where 625 were made
        journal.path.write_text("")
    elif damage == "cut":
        journal.path.write_text("\n".join(lines[:-2]) + "\n")
    elif damage == "another_run":
        train(tiny_config(seed=4), str(tmp_path / "other"), progress=False)
        journal.path.write_bytes((tmp_path / "other" / "releases.jsonl").read_bytes())
    else:
        entry = json.loads(lines[1])                         # line 2's record edited: round 0 -> 1
        if "r" in entry:
            entry["r"]["round"] = 1
        else:
            entry["t"] += 1.0
        lines[1] = json.dumps(entry)
        journal.path.write_text("\n".join(lines) + "\n")
    needle = {"emptied": "holds 0 lines, but the checkpoint was saved when it held 12",
              "cut": "holds 10 lines, but the checkpoint was saved when it held 12",
              "another_run": "differs from the one the checkpoint saw",
              "edited": "line 3 does not follow line 2"}[damage]
    with pytest.raises(ConfigError, match=needle) as refused:
        train(None, out, resume=True, progress=False)
    assert "releases.jsonl" in str(refused.value) and "privfl ledger" in str(refused.value)
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_line_cut_short_by_a_kill_is_dropped_and_the_run_resumes_to_the_uninterrupted_numbers(tmp_path,
                                                                                                  tiny_config):
    full = train(tiny_config(), str(tmp_path / "full"), progress=False)
    out = str(tmp_path / "run")
    journal = _stopped_between_checkpoints(tiny_config(), out)
    with open(journal.path, "a") as f:
        f.write('{"prev": "0", "client_id": 0, "record": {"ev')     # killed mid-append: never delivered
    resumed = train(None, out, resume=True, progress=False)
    assert resumed["novel"] == full["novel"] and resumed["training_val"] == full["training_val"]
    assert ReleaseJournal(journal.path).position().lines == len(journal.path.read_text().splitlines())


def test_a_missing_checkpoint_beside_recorded_releases_is_refused(tmp_path, tiny_config):
    out = str(tmp_path / "run")
    _stopped_between_checkpoints(tiny_config(), out)
    (tmp_path / "run" / "checkpoint.pt").unlink()
    with pytest.raises(ConfigError, match="checkpoint.pt is missing but releases.jsonl records 12 lines"):
        train(None, out, resume=True, progress=False)


def test_a_finished_run_whose_summary_is_deleted_finishes_again_without_serving_its_novel_clients(tmp_path,
                                                                                               tiny_config):
    config = tiny_config("odpflhn", rounds=2, novel_privacy=NovelPrivacy(epsilon=1.0, delta=1e-5))
    out = tmp_path / "run"
    first = train(config, str(out), progress=False)
    assert first["privacy"]["epsilon_max_novel"] == pytest.approx(1.0, rel=1e-6)
    journal = ReleaseJournal(out / "releases.jsonl")
    before = journal.path.read_bytes()
    assert [m["mark"] for m in journal.marks()] == ["novel_clients_served"]
    (out / "summary.json").unlink()
    again = train(None, str(out), resume=True, progress=False)
    # the case: epsilon 1 -> 1.47, the novel clients served again; now nothing is released again
    assert journal.path.read_bytes() == before
    assert again["privacy"]["epsilon_max_novel"] == pytest.approx(1.0, rel=1e-6)
    assert again["novel"] == first["novel"] and again["privacy"]["epsilon_per_client"] == \
        first["privacy"]["epsilon_per_client"]


def test_a_run_stopped_while_serving_novel_clients_is_not_resumed(tmp_path, tiny_config):
    config = tiny_config("odpflhn", rounds=2, novel_privacy=NovelPrivacy(epsilon=1.0, delta=1e-5))
    out = tmp_path / "run"
    train(config, str(out), progress=False)
    (out / "summary.json").unlink()
    lines = (out / "releases.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["mark"] == "novel_clients_served"
    (out / "releases.jsonl").write_text("\n".join(lines[:-2]) + "\n")   # one novel client served, then the kill
    served, record = ReleaseJournal(out / "releases.jsonl").entries()[-1]
    assert record.round is None
    with pytest.raises(ConfigError, match=rf"records releases of novel clients \['{served}'\] but not "
                                          "the end of their service"):
        train(None, str(out), resume=True, progress=False)


def test_checks_that_would_refuse_a_run_after_releases_refuse_it_before_the_first(tmp_path, tiny_config):
    # best-validation selection with too few samples for validation: refused before any release, and a retry
    # needs no --overwrite (the issue: the refusal came after training, and --resume trained and failed again)
    out = tmp_path / "run"
    config = tiny_config(val_fraction=0.001, select="best_val", privacy=TrainingPrivacy())
    with pytest.raises(ConfigError, match="no training client has any at val_fraction=0.001"):
        train(config, str(out), progress=False)
    assert not (out / "releases.jsonl").exists()
    small = tiny_config(privacy=TrainingPrivacy(mode="record", noise_multiplier=1.0, min_samples=500))
    with pytest.raises(ConfigError, match="min_samples=500 is the public lower bound"):
        train(small, str(out), progress=False)
    # the disk must take the round-0 checkpoint, written before the first release
    summary = train(tiny_config(), str(out), progress=False)
    assert summary["rounds_completed"] == 4 and RunDirectory(out).occupant() == "a run"


def test_a_resume_on_a_full_disk_is_refused_before_it_releases_anything(tmp_path, tiny_config, monkeypatch):
    # The in-process engine's resume path (the Flower engine's: tests/federation/test_flower.py): the disk cannot take
    # the next checkpoint beside the one the attempt writes first, so the attempt stops before round 3 is run again.
    import shutil

    from privfl.errors import StorageError

    out = str(tmp_path / "run")
    journal = _stopped_between_checkpoints(tiny_config(), out)
    before = journal.path.read_bytes()
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=4096))
    with pytest.raises(StorageError, match=rf"the disk holding {tmp_path / 'run'} has 0.0 MiB free, but each "
                                           r"checkpoint of this run .* this attempt released nothing"):
        train(None, out, resume=True, progress=False)
    assert journal.path.read_bytes() == before               # nothing released by the refused attempt
    monkeypatch.setattr(shutil, "disk_usage", real)
    resumed = train(None, out, resume=True, progress=False)
    assert resumed["rounds_completed"] == 4
