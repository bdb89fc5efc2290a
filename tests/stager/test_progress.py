from __future__ import annotations

from stager.wire.progress import PUBLISH_S, Progress, SharedCounters, WorkerCounters


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_and_eta_follow_the_injected_clock() -> None:
    clock = FakeClock()
    shared = SharedCounters()
    worker = WorkerCounters(shared, clock=clock)
    progress = Progress(step_names=["copy", "rename"], clock=clock, window_s=10)
    worker.start_step(1)
    worker.add_total(nbytes=1000, files=10)
    worker.flush()
    progress.mirror(shared)
    clock.now += 2
    worker.advance(nbytes=200, files=2)
    progress.mirror(shared)
    snap = progress.snapshot()
    assert snap.rate_bytes_per_s == 100.0
    assert snap.eta_s == 8.0
    # 1-based while the first step runs: "step 1 of 2".
    assert (snap.step, snap.step_index, snap.steps_total) == ("copy", 1, 2)
    assert (snap.files_done, snap.files_total) == (2, 10)


def test_before_the_first_step_the_index_is_zero_and_names_no_step() -> None:
    snap = Progress(step_names=["fetch", "extract", "rename"]).snapshot()
    assert (snap.step, snap.step_index, snap.steps_total) == (None, 0, 3)


def test_worker_counters_cross_the_process_boundary_in_batches() -> None:
    """A million ``advance`` calls must not be a million writes to shared memory."""
    clock = FakeClock()
    shared = SharedCounters()
    writes = []
    real_write = shared.write
    shared.write = lambda values: (writes.append(list(values)), real_write(values))  # type: ignore[method-assign]
    worker = WorkerCounters(shared, clock=clock)
    for _ in range(10_000):
        worker.advance(nbytes=1, files=1)
    assert len(writes) <= 1  # the clock stood still: at most the first call published
    clock.now += 2 * PUBLISH_S
    worker.advance(nbytes=1, files=1)
    assert shared.read()[3:5] == [10_001, 10_001]  # bytes_done, files_done
    worker.advance(files=1)
    worker.flush()  # the end of a step publishes whatever is left
    assert shared.read()[4] == 10_002


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
    names = ["copy", "extract", "rename"]
    shared = SharedCounters()
    worker = WorkerCounters(shared)
    worker.start_step(2)
    worker.add_total(nbytes=50, files=5)
    worker.advance(nbytes=50, files=5)
    worker.flush()
    progress = Progress(step_names=names)
    progress.mirror(shared)
    again = Progress.restore(progress.snapshot(), names)
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
