"""The owner of processes and threads, its own contract (stager/core/processes.py): a
command's end or the sentence why it has none, a bare fork's exit code, a thread's
error kept for the thread that joins it, a forked pool started whole."""

from __future__ import annotations

import os
import sys

import pytest

from stager.core.processes import FORK, NotRun, Threaded, fork_child, fork_pool, run


def test_a_command_runs_to_its_end_and_its_status_is_the_callers() -> None:
    done = run(
        [sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'a\\xff'); sys.exit(3)"], 30
    )
    assert done.returncode == 3 and done.stdout == "a\udcff"  # a byte not UTF-8 kept
    echoed = run([sys.executable, "-c", "print(input())"], 30, input="fed\n")
    assert echoed.stdout == "fed\n"


def test_a_command_that_cannot_run_or_never_ends_is_one_sentence_naming_it() -> None:
    with pytest.raises(NotRun, match="no-such-tool could not be started") as missing:
        run(["/nonexistent/no-such-tool"], 5)
    assert not missing.value.timed_out and isinstance(missing.value, OSError)
    with pytest.raises(NotRun, match="sleep did not answer within 0.2 s") as slow:
        run(["sleep", "30"], 0.2)
    assert slow.value.timed_out


def test_a_bare_fork_exits_with_its_mains_code_or_1_when_it_raises() -> None:
    def fails() -> int:
        raise RuntimeError("in the child")

    codes = []
    for main in (lambda: 7, fails):
        _, status = os.waitpid(fork_child(main), 0)
        codes.append(os.waitstatus_to_exitcode(status))
    assert codes == [7, 1]


class _Failing(Threaded):
    thread_name = "test-failing"

    def run(self) -> None:
        raise ValueError("on its thread")


def test_a_threads_error_is_kept_for_the_thread_that_joins_it() -> None:
    failing = _Failing()
    failing.join()  # not started: nothing to wait for
    failing.start()
    failing.join()
    assert isinstance(failing.error, ValueError)


def test_a_forked_pool_has_every_worker_started_before_it_is_handed_out() -> None:
    pool = fork_pool(2, context=FORK)
    try:
        assert len(pool._processes) == 2  # forked now, before any thread of ours exists
        assert pool.submit(os.getpid).result() != os.getpid()
    finally:
        pool.shutdown()
