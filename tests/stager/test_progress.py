from __future__ import annotations

from stager.progress import Progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_and_eta_follow_the_injected_clock() -> None:
    clock = FakeClock()
    progress = Progress(steps_total=2, clock=clock, window_s=10)
    progress.start_step("copy", 1)
    progress.add_total(nbytes=1000, files=10)
    progress.advance(0)
    clock.now += 2
    progress.advance(nbytes=200, files=2)
    snap = progress.snapshot()
    assert snap.rate_bytes_per_s == 100.0
    assert snap.eta_s == 8.0
    assert (snap.step, snap.step_index, snap.steps_total) == ("copy", 1, 2)
    assert (snap.files_done, snap.files_total) == (2, 10)


def test_a_stall_lowers_the_rate_and_old_samples_leave_the_window() -> None:
    clock = FakeClock()
    progress = Progress(clock=clock, window_s=5)
    progress.add_total(nbytes=10_000)
    for _ in range(5):
        progress.advance(nbytes=100)
        clock.now += 1
    before = progress.rate
    clock.now += 5  # nothing arrives for five seconds
    assert progress.rate < before
    for _ in range(10):
        progress.advance(nbytes=1000)
        clock.now += 1
    # Only the last window counts: ~1000 B/s, not the slow start.
    assert 800 < progress.rate <= 1000


def test_no_eta_without_a_rate_or_a_total() -> None:
    progress = Progress(clock=FakeClock())
    assert progress.snapshot().eta_s is None
    progress.add_total(nbytes=10)
    assert progress.snapshot().eta_s is None


def test_restore_keeps_counters_of_a_stored_snapshot() -> None:
    progress = Progress(steps_total=3)
    progress.start_step("extract", 2)
    progress.add_total(nbytes=50, files=5)
    progress.advance(nbytes=50, files=5)
    again = Progress.restore(progress.snapshot())
    assert again.snapshot().model_dump(exclude={"rate_bytes_per_s", "eta_s"}) == (
        progress.snapshot().model_dump(exclude={"rate_bytes_per_s", "eta_s"})
    )


def test_a_file_total_known_to_be_short_shows_as_unknown() -> None:
    progress = Progress(clock=FakeClock())
    progress.add_total(files=2)  # e.g. two renames announced ...
    progress.advance(files=1410)  # ... while an archive's files were never counted ahead
    assert progress.snapshot().files_total is None
    progress.add_total(files=5000)
    assert progress.snapshot().files_total == 5002
