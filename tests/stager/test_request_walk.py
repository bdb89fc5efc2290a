"""A request's walk through the engine, traced in a real engine (its fork server, its
staging processes, a real copy): a request with no fan-out never enters the fan-out
room (stager/fanout/), from its arrival to its ready dataset; a miss goes to the
caller's process once (its look checks and sizes it), and a hit once (its key is the
sources' fingerprint, which only the caller may look at: a hit never checks nor
sizes). docs/architecture.md, "What happens to a request".

Each engine runs in a Python of its own (``python -m tests.stager.test_request_walk``),
so that its fork server ends with it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import stager
from stager.core.identity import Caller
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.names import Names
from stager.engine.requests import Requests
from stager.engine.scheduler import Engine
from stager.wire.schemas import State

FANOUT = str(Path(stager.__file__).parent / "fanout")


# The list that calls go to now: a thread keeps the profile function it started with
# (the doorway's threads outlive a block), so every block's calls go through this one.
_INTO: list[list[str]] = []


def _profile(frame: Any, event: str, arg: Any) -> None:
    if event == "call" and _INTO and frame.f_code.co_filename.startswith(FANOUT):
        _INTO[-1].append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")


@contextmanager
def entered() -> Iterator[list[str]]:
    """The functions of the fan-out room called meanwhile, on the loop and on the
    engine's threads (traced from their start: with_engine)."""
    calls: list[str] = []
    _INTO.append(calls)
    sys.setprofile(_profile)
    try:
        yield calls
    finally:
        _INTO.remove(calls)
        sys.setprofile(None)


def with_engine(tmp_path: Path, body: Callable[[Engine, Requests, Names], Awaitable[Any]]) -> Any:
    """``body``'s answer, with a started engine of a per-user daemon, stopped after."""
    (tmp_path / "src").mkdir()
    for i in range(3):
        (tmp_path / "src" / f"f{i}").write_bytes(b"x" * 1000)
    settings = Settings(
        cache_dir=tmp_path / "cache", runtime_dir=tmp_path / "run", sweep_interval_s=3600
    )

    async def go() -> Any:
        threading.setprofile(_profile)  # every thread the engine starts, whenever
        engine = Engine(settings, Metrics())
        names = Names(engine)
        requests = Requests(engine, names)
        try:
            await engine.start()
            return await body(engine, requests, names)
        finally:
            await engine.stop()

    return asyncio.run(go())


def stage(requests: Requests, name: str, src: Path) -> Any:
    body = {"name": name, "steps": [{"op": "copy", "src": str(src), "dst": "."}]}
    return requests.ops.request_model().model_validate(body)


async def walk(engine: Engine, requests: Requests, names: Names) -> dict[str, Any]:
    """The fan-out room's functions a miss (to its ready dataset) and a hit entered,
    and those a probe entered."""
    caller, src = Caller.of_process(), engine.settings.cache_dir.parent / "src"
    with entered() as calls:
        await requests.submit(stage(requests, "a", src), caller)
        ready = (await names.wait("a", 60, caller)).state == State.READY
        await requests.submit(stage(requests, "b", src), caller)  # a hit
    with entered() as probed:
        await requests.probe(stage(requests, "c", src), caller)
    return {"ready": ready, "calls": calls, "probed": probed}


async def trips(engine: Engine, requests: Requests, names: Names) -> dict[str, Any]:
    """What a miss, then a hit, ran in the caller's process (Processes.run_as)."""
    found: list[str] = []
    run_as = engine.processes.run_as

    async def counted(who: Any, fn: Any, *args: Any) -> Any:
        found.append(fn.__name__)
        return await run_as(who, fn, *args)

    engine.processes.run_as = counted  # type: ignore[method-assign]
    caller, src = Caller.of_process(), engine.settings.cache_dir.parent / "src"
    await requests.submit(stage(requests, "a", src), caller)
    miss = list(found)
    ready = (await names.wait("a", 60, caller)).state == State.READY
    found.clear()
    _, hit = await requests.submit(stage(requests, "b", src), caller)
    return {"miss": miss, "ready": ready, "hit": hit, "hit_trips": found}


def run(which: str, tmp_path: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.stager.test_request_walk", which, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(stager.__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_request_with_no_fan_out_never_enters_the_fan_out_room(tmp_path: Path) -> None:
    found = run("walk", tmp_path)
    assert found["ready"]
    assert found["calls"] == [], f"a request with no fan-out entered the fan-out room: {found}"
    # The tracer sees the room when a request takes part in a fan-out (a probe), on the
    # loop and on the doorway's thread (the sources' look, as the caller).
    assert any(call.endswith(":source_files") for call in found["probed"]), found
    assert any(call.endswith(":broadcastable_sources") for call in found["probed"]), found


def test_a_miss_goes_to_the_callers_process_once_and_a_hit_once(tmp_path: Path) -> None:
    found = run("trips", tmp_path)
    assert found["miss"] == ["look"], f"a miss went to the caller's process: {found['miss']}"
    assert found["ready"] and found["hit"], found
    assert found["hit_trips"] == ["look"], f"a hit went there: {found['hit_trips']}"


if __name__ == "__main__":
    answer = with_engine(Path(sys.argv[2]), {"walk": walk, "trips": trips}[sys.argv[1]])
    print(json.dumps(answer))
