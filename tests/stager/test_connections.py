"""The connection caps' own contract, without a daemon (stager/api/connections.py): the
caps lowered to fit the descriptors, and the gate's count of each user's connections
(in all, per user, the places kept for users who hold few, root's way in).
tests/stager/test_connection_limits.py has the daemon's, test_burst_log.py the log's."""

from __future__ import annotations

from pathlib import Path

from stager.api.connections import FEW, ROOT, Caps, Gate, caps_for
from stager.core.settings import Settings


def gate(total: int, per_user: int = 100, reserve: int = 0, ceiling: int = 1000) -> Gate:
    caps = Caps(total=total, per_user=per_user, reserve=reserve, ceiling=ceiling, multi_user=True)
    return Gate(caps, header_timeout_s=5.0)


def admitted(g: Gate, uid: int | None, n: int) -> None:
    for _ in range(n):
        assert g.admit(uid) is None


def test_the_caps_are_lowered_to_half_the_descriptors_with_a_sentence(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path, runtime_dir=tmp_path, max_connections=5000)
    caps, notes = caps_for(settings, descriptors=1024)
    assert (caps.ceiling, caps.total, caps.backlog) == (512, 512, 256)
    assert len(notes) == 1 and "max_connections 5000 lowered to 512" in notes[0]
    multi = settings.model_copy(update={"multi_user": True})
    caps, notes = caps_for(multi, descriptors=1024)
    assert caps.total == 384 and "a quarter of it kept for root" in notes[0]
    caps, notes = caps_for(settings.model_copy(update={"max_connections": 100}), 1024)
    assert caps.total == 100 and notes == []


def test_every_user_together_is_held_to_the_total_and_a_release_frees_a_place() -> None:
    g = gate(total=3)
    admitted(g, 1, 2)
    admitted(g, 2, 1)
    refused = g.admit(3)
    assert refused is not None and refused.limit == "max_connections"
    assert "--max-connections 3" in refused.sentence
    g.release(1)
    assert g.admit(3) is None


def test_one_user_is_held_to_their_own_cap() -> None:
    g = gate(total=100, per_user=2)
    admitted(g, 1, 2)
    refused = g.admit(1)
    assert refused is not None and refused.limit == "max_connections_per_user"
    assert "uid 1 holds 2" in refused.sentence
    assert g.admit(2) is None  # another user is not


def test_the_last_places_are_kept_for_users_who_hold_few() -> None:
    g = gate(total=FEW + 3, reserve=2)
    admitted(g, 1, FEW + 1)  # one user past FEW, the reserve's places still free
    refused = g.admit(1)
    assert refused is not None and refused.limit == "connection_reserve"
    assert g.admit(2) is None  # a user holding few takes a kept place
    assert g.admit(2) is None
    assert g.admit(3).limit == "max_connections"  # type: ignore[union-attr]


def test_root_is_refused_only_at_the_descriptors_ceiling() -> None:
    g = gate(total=1, per_user=1, ceiling=4)
    admitted(g, 1, 1)
    admitted(g, ROOT, 3)  # past every user cap: root's connections are not counted there
    refused = g.admit(ROOT)
    assert refused is not None and refused.limit == "RLIMIT_NOFILE"


def test_a_per_user_daemon_counts_connections_without_users() -> None:
    caps = Caps(total=2, per_user=1, reserve=1, ceiling=10, multi_user=False)
    g = Gate(caps, header_timeout_s=5.0)
    admitted(g, None, 2)  # no per-user cap or reserve: one user, or TCP
    assert g.admit(None).limit == "max_connections"  # type: ignore[union-attr]
