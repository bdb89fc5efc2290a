"""The download rate floor's judgement, on a made-up timeline: what it counts from,
what it ignores (a silent start), and the sentence it fails a staging with. The
real trickling server is in test_slow_download.py."""

from __future__ import annotations

from stager.staging.download_rate import DownloadRateFloor

STEPS = [
    {"op": "fetch", "url": "https://user:pw@host/data.tar?sig=abc", "dst": "data.tar"},
    {"op": "extract", "src": "data.tar", "dst": "."},
]


def feed(floor: DownloadRateFloor, timeline: list[tuple[float, int, int]]) -> list[str | None]:
    return [floor.check(now, step, done) for now, step, done in timeline]


def test_a_trickle_fails_once_a_window_has_passed_since_its_first_bytes() -> None:
    floor = DownloadRateFloor(STEPS, min_bytes_per_s=1000, window_s=10)
    # 100 bytes a second from t=5: judged at t=15, a window after the first bytes.
    verdicts = feed(floor, [(t, 1, 0 if t < 5 else 100 * (t - 4)) for t in range(16)])
    assert verdicts[:15] == [None] * 15
    assert verdicts[15] is not None
    assert verdicts[15].startswith(
        "downloading https://***@host/data.tar?*** (step 1) brought 1000 bytes in the last 10 s"
    )
    assert "--min-download-rate" in verdicts[15] and "abc" not in verdicts[15]


def test_silence_before_the_first_bytes_is_not_slowness() -> None:
    """A resumed download hashes its kept bytes first, in silence, for minutes; then
    counts them at once and goes on at a good rate."""
    floor = DownloadRateFloor(STEPS, min_bytes_per_s=1000, window_s=10)
    silent = [(float(t), 1, 0) for t in range(0, 300, 5)]
    flowing = [(300 + t / 10, 1, 5_000_000 + 20_000 * t) for t in range(200)]
    assert feed(floor, silent + flowing) == [None] * (len(silent) + len(flowing))


def test_only_a_download_step_is_judged_and_each_step_afresh() -> None:
    floor = DownloadRateFloor(STEPS, min_bytes_per_s=1000, window_s=10)
    fast = [(float(t), 1, 100_000 * t) for t in range(20)]
    # The extraction that follows brings few bytes: it is no download.
    slow_extract = [(20.0 + t, 2, 2_000_000 + t) for t in range(30)]
    assert feed(floor, fast + slow_extract) == [None] * 50
    assert DownloadRateFloor(STEPS, 0, 10).check(100, 1, 1) is None  # 0: no floor
