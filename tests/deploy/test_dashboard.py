"""deploy/grafana/stager-node.json, against a real Prometheus (Debian's package,
installed here when missing) that scrapes a real daemon while it stages: every
query of every panel answers with data."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.daemon import Daemon, free_port, stage, stage_ready
from tests.trees import make_tar, write_tree

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "stager-node.json"
# What Grafana puts in place of its variables before it asks Prometheus.
GRAFANA = {"$__rate_interval": "1m", "$instance": ".*", "${datasource}": "prometheus"}
# Labels that would make a series per person or per job.
WHO = re.compile(r"\b(user|uid|owner|job|job_id|slurm_job_id|name|dataset|holder)=")


def panel_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def query(base: str, expr: str) -> list[dict]:
    answer = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    assert answer.status_code == 200, (expr, answer.text)
    return answer.json()["data"]["result"]


def wait_for(base: str, expr: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not query(base, expr):
        assert time.monotonic() < deadline, f"Prometheus never answered {expr} in {timeout} s"
        time.sleep(0.5)


def as_grafana_sends(expr: str) -> str:
    for variable, value in GRAFANA.items():
        expr = expr.replace(variable, value)
    return expr


def prometheus_binary() -> str:
    """Debian's prometheus, installed as the project's set-up does when it is missing."""
    script = f"source {REPO}/deploy/slurm/packages.sh && apt_install_missing prometheus prometheus"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.skip(f"Debian's prometheus package cannot be installed here: {done.stderr[-500:]}")
    return "prometheus"


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str], tuple[str, int]]]:
    """Starts Prometheus scraping ``host:port`` every second; yields its base URL."""
    binary = prometheus_binary()
    started: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: stager\n    static_configs: [{{targets: ['{target}']}}]\n"
        )
        port = free_port()
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"),  # noqa: SIM115
        )  # fmt: skip
        started.append(process)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/-/ready", timeout=1).status_code == 200:
                    return base
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError((tmp_path / "prometheus.log").read_text()[-2000:])

    yield start
    for process in started:
        process.terminate()
        process.wait(timeout=30)


def test_every_panel_answers_from_a_real_prometheus(
    daemon_factory: Callable[..., Daemon], prometheus, tmp_path: Path
) -> None:
    port = free_port()
    daemon = daemon_factory(args=["--host", "127.0.0.1", "--port", str(port), "--no-token"])
    base = prometheus(f"127.0.0.1:{port}")
    archive = make_tar(write_tree(tmp_path / "t", n_files=20, max_size=20_000), tmp_path / "a.tar")
    wait_for(base, "up == 1")  # scraped before the requests: their rates are the test's
    with daemon.client() as client:
        body = {"name": "imgs", "steps": [{"op": "extract", "src": str(archive)}]}
        stage_ready(client, body)
        stage_ready(client, body)  # a hit
        # A download from a port nobody listens on: a staging that fails.
        url = f"http://127.0.0.1:{free_port()}/x.bin"
        failing = {"name": "gone", "steps": [{"op": "fetch", "url": url, "dst": "x.bin"}]}
        assert stage(client, failing).status_code == 202
        assert client.get("/v1/datasets/gone/wait", params={"timeout": 30}).json()["state"] == (
            "failed"
        )
        exposed = client.get("/metrics").text
    assert not WHO.search(exposed), "a metric is labelled by who: " + str(WHO.findall(exposed))
    # Prometheus applies its targets some seconds after it starts: wait until it has
    # scraped the counters as the requests left them.
    seen = "count_over_time(stager_hit_bytes_total[1m]) and stager_hit_bytes_total > 0"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = query(base, seen)
        if found and float(found[0]["value"][1]) >= 2:
            break
        time.sleep(0.5)
    else:
        raise TimeoutError("Prometheus did not scrape the daemon twice within 60 s")

    empty = []
    for title, expr in panel_queries():
        if not query(base, as_grafana_sends(expr)):
            empty.append(f"{title}: {as_grafana_sends(expr)}")
    assert not empty, "panels with no data:\n" + "\n".join(empty)
    # The hit ratio is the one the daemon saw: one hit among two requests (and a miss).
    ratio = query(base, as_grafana_sends(panel_queries()[0][1]))[0]["value"][1]
    assert 0 < float(ratio) < 1, ratio


def test_the_dashboard_names_metrics_a_real_node_service_exports(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Every metric a panel asks for is in the /metrics of a real node service (a renamed
    metric would leave a blank panel), and pre-staging has its panels."""
    daemon = daemon_factory(args=["--multi-user"])
    with daemon.client() as client:
        exposed = client.get("/metrics").text
    names = set(re.findall(r"^(stager_\w+?)(?:\{| )", exposed, re.M))
    asked = {m for _, expr in panel_queries() for m in re.findall(r"\b(stager_\w+)", expr)}
    assert asked and asked <= names, sorted(asked - names)
    prestaging = {
        "stager_prefetches_total",
        "stager_prefetch_bytes_total",
        "stager_prefetch_hidden_seconds_total",
    }
    assert prestaging <= asked, sorted(prestaging - asked)
    by_outcome = [e for _, e in panel_queries() if "by (outcome)" in e and "stager_prefetch" in e]
    assert len(by_outcome) == 2  # started, used, wasted (and failed, refused): count, bytes
