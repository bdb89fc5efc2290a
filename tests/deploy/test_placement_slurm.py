"""Cache-aware placement against a real slurmctld: the node service keeps a stg_ node
feature for each declared dataset it holds ready (and drops it at eviction, restores it
after `scontrol reconfigure`, bounds it per node and per user), and job_submit.lua
gives a job that declares data `--prefer` for the same names (computed in Lua 5.1,
as slurmctld runs it, and compared with stager/prestage/placement/names.py)."""

from __future__ import annotations

import json
import random
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from client.declare import declared_lines
from stager.prestage.placement.names import PATTERN, feature
from tests.daemon import Daemon, node_service
from tests.slurm_cluster import CONFIG, REPO, Cluster, job_info, read_env_file, unavailable
from tests.trees import write_tree
from tests.users import User

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HOST = socket.gethostname().split(".")[0]
PERIOD_S = 2.0
LUA = REPO / "deploy" / "slurm" / "job_submit.lua"
HOLD = ["--parsable", "--hold", "--chdir=/tmp", "--output=/dev/null", "--time=5"]


def node_features() -> tuple[list[str], list[str]]:
    """(AvailableFeatures, ActiveFeatures) as scontrol prints them."""
    out = subprocess.run(
        ["scontrol", "show", "node", HOST, "--oneliner"], capture_output=True, text=True
    ).stdout
    found = [re.search(rf"(?:^|\s){f}=(\S*)", out) for f in ("AvailableFeatures", "ActiveFeatures")]
    return tuple(  # type: ignore[return-value]
        [] if m is None or m.group(1) in ("", "(null)") else m.group(1).split(",") for m in found
    )


def ours() -> set[str]:
    available, active = node_features()
    assert {f for f in available if PATTERN.fullmatch(f)} == {
        f for f in active if PATTERN.fullmatch(f)
    }, (available, active)
    return {f for f in available if f.startswith("stg_")}


def until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.2)


def set_features(features: list[str]) -> None:
    listed = ",".join(features)
    subprocess.run(
        ["scontrol", "update", f"NodeName={HOST}", f"AvailableFeatures={listed}",
         f"ActiveFeatures={listed}"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip


@pytest.fixture
def service(local_cluster: Cluster, shared_tmp: Path) -> Iterator[Daemon]:
    """A node service keeping this node's features: at most 3, 2 per user, checked
    every 2 s. The node starts with a feature of the admin's, and ends with none."""
    set_features(["site_a"])
    try:
        with node_service(
            shared_tmp / "cache",
            STAGER_SLURM_NODE_FEATURES="1",
            STAGER_SLURM_NODE_FEATURES_MAX="3",
            STAGER_SLURM_NODE_FEATURES_PER_USER="2",
            STAGER_SLURM_NODE_FEATURES_PERIOD_S=str(PERIOD_S),
        ) as daemon:
            yield daemon
    finally:
        set_features([])


def step_words(name: str, source: Path) -> str:
    return f"{name} --step '{json.dumps({'op': 'copy', 'src': str(source)})}'"


def sources(shared_tmp: Path, *names: str) -> dict[str, Path]:
    made = {}
    for name in names:
        made[name] = write_tree(shared_tmp / "storage" / name, n_files=3, max_size=500)
    for path in [shared_tmp / "storage", *(shared_tmp / "storage").rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return made


def stage_declared(user: User, service: Daemon, python: str, folder: Path, *words: str) -> None:
    """``stager-client stage --from-script`` as ``user``, as a job does at its start."""
    script = folder / f"job-{user.name}-{len(list(folder.glob('job-*')))}.sh"
    script.write_text("#!/bin/bash\n" + "".join(f"#STAGER {w}\n" for w in words) + "true\n")
    script.chmod(0o644)
    argv = [python, "-m", "client", "stage", "--from-script", str(script), "--wait"]
    done = user.run(argv, env={"STAGER_URL": f"unix://{service.socket}"}, cwd="/")
    assert done.returncode == 0, done.stderr


def test_declared_data_tags_its_node_until_evicted_and_outlives_a_reconfigure(
    service: Daemon, users: tuple[User, User], shared_tmp: Path, interpreter_for_users: str
) -> None:
    alice, _ = users
    data = sources(shared_tmp, "d1")
    words = step_words("d1", data["d1"])
    stage_declared(alice, service, interpreter_for_users, shared_tmp, words)
    until(lambda: ours() == {feature(words)}, "the feature of alice's declared data")
    available, active = node_features()
    assert "site_a" in available and "site_a" in active  # the admin's feature is kept

    # Slurm forgets run-time features at a reconfigure: the next check sets them again.
    writes = service.log(None).count("stager features are now")
    subprocess.run(["scontrol", "reconfigure"], check=True, capture_output=True, timeout=60)
    until(
        lambda: (
            ours() == {feature(words)}
            and service.log(None).count("stager features are now") == writes + 1
        ),
        "the feature set again after `scontrol reconfigure`",
        timeout=PERIOD_S + 20,
    )

    done = alice.run(
        [interpreter_for_users, "-m", "client", "cancel", "d1"],
        env={"STAGER_URL": f"unix://{service.socket}"}, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    until(lambda: ours() == set(), "the feature gone with the evicted data")


def test_features_are_bounded_per_node_and_per_user_most_recent_first(
    service: Daemon, users: tuple[User, User], shared_tmp: Path, interpreter_for_users: str
) -> None:
    alice, bob = users
    data = sources(shared_tmp, "a1", "a2", "b1", "b2", "b3")
    words = {name: step_words(name, path) for name, path in data.items()}
    stage_declared(alice, service, interpreter_for_users, shared_tmp, words["a1"], words["a2"])
    until(lambda: ours() == {feature(words["a1"]), feature(words["a2"])}, "alice's two")
    # bob's three newer ones: at most 2 of his, so alice's newest keeps its place.
    stage_declared(bob, service, interpreter_for_users, shared_tmp, words["b1"], words["b2"])
    stage_declared(bob, service, interpreter_for_users, shared_tmp, words["b3"])
    expected = {feature(words[n]) for n in ("a2", "b2", "b3")}
    until(lambda: ours() == expected, f"the 3 most recent, 2 per user: {expected}")
    # A hit is a use: alice's a1 is the most recent now, and the least recent goes.
    stage_declared(alice, service, interpreter_for_users, shared_tmp, words["a1"])
    expected = {feature(words[n]) for n in ("a1", "b2", "b3")}
    until(lambda: ours() == expected, f"a1 back among the 3 most recent: {expected}")


def test_a_user_tags_only_data_their_request_declares_and_cannot_inject(
    service: Daemon, users: tuple[User, User], shared_tmp: Path, interpreter_for_users: str
) -> None:
    alice, bob = users
    data = sources(shared_tmp, "mine", "theirs", "odd, =AvailableFeatures=evil x;|")
    mine, theirs = step_words("mine", data["mine"]), step_words("theirs", data["theirs"])
    request = {"name": "mine", "steps": [{"op": "copy", "src": str(data["mine"])}]}
    refused = [
        theirs,  # the words of data bob did not ask for
        "stg_deadbeef",  # a feature's name, not a declaration
        'mine --step \'{"op": "copy", "src": "/etc"}\'',  # his name, other data
        "mine --step '" + json.dumps(request["steps"][0]) + "' --as-image",  # other spec
    ]
    for words in refused:
        code, answer = bob.curl(
            service.socket, "POST", "/v1/datasets", {**request, "declared": words}
        )
        assert code in (200, 202), answer  # the staging itself goes on
    # Then his own declaration of it: its feature alone (bob has room for 2).
    stage_declared(bob, service, interpreter_for_users, shared_tmp, mine)
    until(lambda: ours() == {feature(mine)}, "the feature of the data bob declared, alone")
    # What scontrol is handed comes from a hash, whatever the words hold.
    odd = step_words("odd", data["odd, =AvailableFeatures=evil x;|"])
    stage_declared(bob, service, interpreter_for_users, shared_tmp, odd)
    until(lambda: ours() == {feature(odd), feature(mine)}, "bob's two declared datasets")
    available, active = node_features()
    assert not any("evil" in f or " " in f for f in available + active), available
    assert "do not declare its request" in service.log(None)


# ---- job_submit.lua: --prefer --------------------------------------------------------


@pytest.fixture
def jobs(local_cluster: Cluster) -> Iterator[list[str]]:
    submitted: list[str] = []
    try:
        yield submitted
    finally:
        if submitted:
            subprocess.run(["scancel", *submitted], capture_output=True, timeout=60)


def submit(user: User | None, script: str, jobs: list[str], *flags: str) -> dict[str, str]:
    argv = ["sbatch", *HOLD, *flags]
    if user is None:
        done = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=60)
    else:
        done = user.run(argv, input=script)
    assert done.returncode == 0, f"sbatch refused the job: {done.stderr}"
    jobs.append(done.stdout.strip().split(";")[0])
    return job_info(jobs[-1])


def expected_prefer(script: str) -> str | None:
    """What job_submit.lua should set, by stager's Python: each line's feature."""
    found = [feature(words) for _, words in declared_lines(script) if words]
    return "&".join(found) or None


def test_a_job_that_declares_data_prefers_its_features_and_others_are_left_alone(
    jobs: list[str], users: tuple[User, User]
) -> None:
    alice, _ = users
    declared = ["inat --recipe inat2021 --source /net/inat", 'x --step \'{"op": "copy"}\'']
    script = "#!/bin/bash\n" + "".join(f"#STAGER {d}\n" for d in declared) + "true\n"
    assert submit(alice, script, jobs).get("Prefer") == "&".join(map(feature, declared))
    assert submit(alice, script, jobs, "--prefer=site_a").get("Prefer") == "site_a"
    assert "Prefer" not in submit(None, script, jobs)  # root's job
    assert "Prefer" not in submit(alice, "#!/bin/bash\ntrue\n", jobs)  # declares nothing


def generated_scripts(count: int, seed: int, printable: bool) -> list[bytes]:
    """Job scripts with #STAGER lines of odd words: quotes, %, ;, |, tabs and runs of
    blanks inside, UTF-8 beyond ASCII, and (unless ``printable``) control bytes and
    bytes that are no UTF-8."""
    rng = random.Random(seed)
    alphabet = list("abcxyz019 -_/'\"%;|=,.{}:\t") + ["é", "数据", "\u00a0"]
    if not printable:
        alphabet += ["\x01", "\x1f", "\x7f", "\udcff"]  # \udcff: the byte 0xff, kept
    scripts = []
    for _ in range(count):
        lines = ["#!/bin/bash", "#SBATCH --time=5"]
        for _ in range(rng.randint(0, 5)):
            words = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
            gap, tail = rng.choice([" ", "\t", "  \t "]), rng.choice(["", " ", " \t"])
            lines.append(f"#STAGER{gap}{words}{tail}")
            if rng.random() < 0.2:
                lines.append(rng.choice(["", "# a comment", "#STAGERX no", "#STAGER"]))
        lines.append("true")
        scripts.append("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
    return scripts


def lua_prefers(scripts: list[bytes], tmp: Path, conf: str, uid: int = 1000) -> list[str | None]:
    """Each script's prefer as job_submit.lua sets it, run by Lua 5.1 (slurmctld's Lua on
    Debian 12) outside slurmctld, beside a slurm.conf holding ``conf``."""
    lua = shutil.which("lua5.1")
    if lua is None:
        unavailable("needs lua5.1, the Lua Debian's slurm-wlm links (up.sh installs it)")
    shutil.copy(LUA, tmp / "job_submit.lua")
    (tmp / "slurm.conf").write_text(conf)
    (tmp / "scripts").write_bytes(b"".join(b"%d\n%s" % (len(s), s) for s in scripts))
    (tmp / "run.lua").write_text(
        "slurm = {SUCCESS = 0, log_info = function() end, log_error = function(...)\n"
        "  io.stderr:write(string.format(...), '\\n') end}\n"
        f"dofile('{tmp}/job_submit.lua')\n"
        f"local input = io.open('{tmp}/scripts', 'rb')\n"
        "while true do\n"
        "  local size = input:read('*n')\n"
        "  if size == nil then break end\n"
        "  input:read(1)\n"
        "  local job = {script = input:read(size)}\n"
        f"  slurm_job_submit(job, {{}}, {uid})\n"
        "  print(job.prefer or '-')\n"
        "end\n"
    )
    done = subprocess.run([lua, str(tmp / "run.lua")], capture_output=True, timeout=120)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return [None if p == "-" else p for p in done.stdout.decode().splitlines()]


def test_lua_and_python_name_the_same_features_for_generated_declarations(
    local_cluster: Cluster, tmp_path: Path
) -> None:
    scripts = generated_scripts(2000, seed=42, printable=False)
    conf = "ClusterName=x\nSchedulerParameters=bf_interval=30,ignore_prefer_validation\n"
    got = lua_prefers(scripts, tmp_path, conf)
    expected = [expected_prefer(s.decode("utf-8", "surrogateescape")) for s in scripts]
    assert sum(p is not None for p in expected) > 1000  # most declare something
    assert got == expected
    # Without ignore_prefer_validation an unknown feature would reject the job: no
    # prefer at all then. Nor for root's jobs.
    assert set(lua_prefers(scripts[:50], tmp_path, "ClusterName=x\n")) == {None}
    assert set(lua_prefers(scripts[:50], tmp_path, conf, uid=0)) == {None}


def test_slurmctlds_lua_names_the_same_features_as_python(
    jobs: list[str], users: tuple[User, User]
) -> None:
    alice, _ = users
    for script in generated_scripts(25, seed=7, printable=True):
        text = script.decode()
        assert submit(alice, text, jobs).get("Prefer") == expected_prefer(text), text


def test_a_job_declaring_data_the_node_holds_prefers_it_and_hits(
    service: Daemon,
    users: tuple[User, User],
    shared_tmp: Path,
    interpreter_for_users: str,
    jobs: list[str],
) -> None:
    alice, _ = users
    data = sources(shared_tmp, "held")
    words = step_words("held", data["held"])
    stage_declared(alice, service, interpreter_for_users, shared_tmp, words)
    until(lambda: ours() == {feature(words)}, "the feature of the data the node holds")
    out = shared_tmp / "out"
    out.mkdir()
    shutil.chown(out, alice.uid, alice.gid)
    # The job's own staging reads its batch script as slurmctld stored it, as in a job.
    script = (
        f"#!/bin/bash\n#STAGER {words}\n"
        # The node service under test, not the daemon the task prolog points the job at.
        f"STAGER_URL=unix://{service.socket} {interpreter_for_users} -m client stage "
        "--from-script --json\n"
    )
    argv = ["sbatch", *HOLD[:2], "--time=5", "--chdir=/", f"--output={out}/job-%j.out"]
    done = alice.run(argv, input=script)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    jobs.append(job)
    # Slurm 22.05 shows a job's prefer until it is allocated, not after.
    assert job_info(job)["Prefer"] == feature(words)
    subprocess.run(["scontrol", "release", job], check=True, capture_output=True, timeout=30)
    try:
        until(lambda: job_info(job).get("JobState") in ENDED, f"job {job} ended", 120)
    finally:
        stop_prolog_daemon(alice, interpreter_for_users)
    info = job_info(job)
    output = next(out.glob("job-*.out")).read_text()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == HOST, output
    (status,) = json.loads(output)["data"]
    assert status["state"] == "ready" and status["origin"]["hit"] is True, status


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def stop_prolog_daemon(user: User, python: str) -> None:
    """The per-user daemon the prolog started for the job (the job used the node
    service, through STAGER_URL): stopped, as the epilog would with STAGER_EPILOG_STOP."""
    pattern = read_env_file(CONFIG).get("STAGER_SLURM_RUNTIME_DIR", "/tmp/stager-%U")
    runtime = pattern.replace("%U", str(user.uid)).replace("%u", user.name)
    user.run([python, "-m", "stager", "stop", "--runtime-dir", runtime], cwd="/")


def test_a_job_array_declaring_data_gets_no_prefer_and_runs(
    jobs: list[str], users: tuple[User, User], interpreter_for_users: str
) -> None:
    """Slurm 22.05 keeps an array whose prefer no node meets pending for good
    (Reason=BadConstraints, on an idle node), where a single job falls back: an array
    gets no prefer, and its tasks run."""
    alice, _ = users
    text = "#!/bin/bash\n#STAGER inat --recipe inat2021 --source /net/inat\nsleep 1\n"
    array = submit(alice, text, jobs, "--array=1-2")
    assert array.get("Prefer") in (None, "(null)"), array
    subprocess.run(["scontrol", "release", array["JobId"]], capture_output=True, timeout=60)
    try:
        deadline, queued = time.monotonic() + 90, ["squeue", "--noheader", "-j", array["JobId"]]
        while subprocess.run(queued, capture_output=True, text=True, timeout=60).stdout.strip():
            assert time.monotonic() < deadline, job_info(array["JobId"])
            time.sleep(2)
    finally:
        stop_prolog_daemon(alice, interpreter_for_users)
