"""What a staging or a user's process answers (stager/rights/channel.py) comes back in
the daemon as it was raised: stager's errors by class and sentence, an OS error by
number and text, and the sentence of an OS error that has no number (gzip's bad data,
a command that could not start) is not lost on the way."""

from __future__ import annotations

import gzip
import pickle

import pytest

from stager.core.errors import Cancelled, StagerError, StagingError, from_os_error
from stager.core.processes import NotRun
from stager.rights import channel


def _round_trip(exc: BaseException, other: type[StagerError] = StagerError) -> BaseException:
    answer = pickle.loads(pickle.dumps(channel.failure(exc)))  # as a staging sends it
    with pytest.raises(BaseException) as raised:
        channel.result(answer, other)
    return raised.value


def test_stagers_errors_come_back_by_class_and_sentence() -> None:
    back = _round_trip(Cancelled("staging was cancelled"), StagingError)
    assert type(back) is Cancelled and str(back) == "staging was cancelled"

    class NotInErrors(StagerError):
        type = "elsewhere"

    back = _round_trip(NotInErrors("made in an op's module"), StagingError)
    assert type(back) is StagingError and str(back) == "made in an op's module"


def test_an_os_error_comes_back_with_its_number_text_and_file() -> None:
    back = _round_trip(FileNotFoundError(2, "No such file or directory", "/data/a"))
    assert isinstance(back, FileNotFoundError)
    assert (back.errno, back.strerror, back.filename) == (2, "No such file or directory", "/data/a")


@pytest.mark.parametrize(
    "exc",
    [gzip.BadGzipFile("Not a gzipped file (b'PK')"), NotRun("tar could not be started: gone")],
    ids=["gzip", "NotRun"],
)
def test_an_os_error_without_a_number_keeps_its_sentence(exc: OSError) -> None:
    back = _round_trip(exc)
    assert isinstance(back, OSError)
    assert str(exc) in from_os_error(back, "staging").message


def test_an_os_error_on_a_name_that_is_not_text_keeps_the_name() -> None:
    back = _round_trip(FileNotFoundError(2, "No such file or directory", b"/data/\xff"))
    assert isinstance(back, FileNotFoundError) and back.filename == "b'/data/\\xff'"
    assert "/data/" in str(back)
