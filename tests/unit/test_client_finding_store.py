"""The findings a client caught first-hand (client.routing.finding_store): one per accused, bounded in count and
bytes (the oldest goes), in memory or in a directory; the peer ids caught are banned again by a client given the same
directory, and nothing else there bans anyone (a finding received from someone else and put in the directory, a
forged `liars` line that is not a peer id)."""

from __future__ import annotations

import pytest
import torch

from corolla.cli.findings import main as findings_main
from corolla.client.routing.finding_store import LIARS_FILE, MAX_LIARS, FindingStore
from corolla.client.routing.findings import Finding, decode_finding, encode_finding
from helpers.fake_chain import HIDDEN, FakeManager


def _finding(peer_id: str, positions: int = 4) -> Finding:
    inputs = torch.randn(1, positions, HIDDEN)
    return Finding(peer_id, (0, 2), inputs, inputs[:, 1:] + 1, 1)


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "directory"])
def test_one_finding_per_accused_bounded_in_count_and_bytes(tmp_path, on_disk) -> None:
    size = len(encode_finding(_finding("a")))
    store = FindingStore(tmp_path if on_disk else None, max_count=2, max_bytes=10 * size)
    first = _finding("a")
    assert store.record_caught(first) is not None
    assert store.record_caught(_finding("a")).peer_id == "a"  # caught again: the first finding stays
    assert torch.equal(decode_finding(store.read("a") or b"").inputs, first.inputs)
    for peer in ("b", "c"):
        store.record_caught(_finding(peer))
    assert [e.peer_id for e in store.entries()] == ["b", "c"]  # count bound 2: the oldest went
    assert store.liars() == ["a", "b", "c"]  # the bans stay
    assert all((e.path is not None) == on_disk for e in store.entries())
    big = FindingStore(tmp_path / "big" if on_disk else None, max_count=8, max_bytes=size + size // 2)
    big.record_caught(_finding("a"))
    big.record_caught(_finding("b"))
    assert [e.peer_id for e in big.entries()] == ["b"]  # byte bound: two would not fit
    assert big.record_caught(_finding("c", positions=64)) is None and big.liars() == ["a", "b", "c"]  # alone too big


def test_a_client_given_the_directory_bans_what_it_caught_and_nothing_else(tmp_path) -> None:
    store = FindingStore(tmp_path, max_count=4, max_bytes=1 << 20)
    store.record_caught(_finding("liar"))
    # a finding received from someone else, put in the directory, and lines that are not peer ids: no ban
    (tmp_path / "honest.finding").write_bytes(encode_finding(_finding("honest")))
    with open(tmp_path / LIARS_FILE, "a") as file:
        file.write("../etc/passwd\n\n" + "x" * 200 + "\n")
    manager = FakeManager({}, 2, findings_dir=str(tmp_path))
    assert manager.bans.is_liar("liar") and manager.bans.banned_peers() == {"liar"}
    assert sorted(e.peer_id for e in manager.findings.entries()) == ["honest", "liar"]  # shared onward, not trusted
    assert FakeManager({}, 2).bans.banned_peers() == set()  # no directory: nothing carried over


def test_the_liars_file_is_bounded(tmp_path) -> None:
    (tmp_path / LIARS_FILE).write_text("".join(f"peer{i}\n" for i in range(MAX_LIARS + 10)))
    store = FindingStore(tmp_path, max_count=1, max_bytes=1 << 20)
    assert len(store.liars()) == MAX_LIARS
    store.record_caught(_finding("late"))  # banned by the caller for this process, not persisted past the bound
    assert "late" not in store.liars() and "late" not in (tmp_path / LIARS_FILE).read_text()


def test_corolla_findings_refuses_a_bad_file_before_reaching_the_swarm(tmp_path, capsys) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    bad = tmp_path / "bad.finding"
    bad.write_bytes(encode_finding(_finding("peer"))[:-5])
    code = findings_main([str(model), str(bad), "--findings_dir", str(tmp_path / "mine")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"corolla-findings: error: {bad}: undecodable finding")
    assert not (tmp_path / "mine").exists()  # nothing started, nothing written
