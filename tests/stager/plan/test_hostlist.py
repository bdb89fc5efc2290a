"""Slurm hostlists expanded as `scontrol show hostnames` expands them."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from stager.prestage.plan.hostlist import HostlistError, expand

CASES = {
    "node1": ["node1"],
    "node[1-3]": ["node1", "node2", "node3"],
    "node[1-4,7]": ["node1", "node2", "node3", "node4", "node7"],
    "gpu[01-03],cpu7": ["gpu01", "gpu02", "gpu03", "cpu7"],
    "n[08-11]": ["n08", "n09", "n10", "n11"],
    "rack[1-2]-n[1-2]": ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"],
    "a[1],b": ["a1", "b"],
    "vm": ["vm"],
}


@pytest.mark.parametrize("text", sorted(CASES))
def test_expands_as_slurm_does(text: str) -> None:
    assert list(expand(text)) == CASES[text]


@pytest.mark.parametrize("text", ["", "(null)", "N/A", "None", "  "])
def test_slurms_words_for_none_are_no_hosts(text: str) -> None:
    assert expand(text) == ()


@pytest.mark.parametrize("text", ["node[1-3", "node1-3]", "node[a-b]", "node[3-1]", "n[1-]"])
def test_a_broken_hostlist_is_refused_naming_it(text: str) -> None:
    with pytest.raises(HostlistError, match="hostlist"):
        expand(text)


@pytest.mark.parametrize("text", ["n[0-999999]", "a[0-99999]b[0-99999]", "a[0-60000],b[0-60000]"])
def test_a_hostlist_of_absurd_length_is_refused(text: str) -> None:
    with pytest.raises(HostlistError, match="too long|more than"):
        expand(text)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs Slurm's scontrol")
@pytest.mark.parametrize("text", sorted(CASES))
def test_agrees_with_scontrol_show_hostnames(text: str) -> None:
    done = subprocess.run(
        ["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        pytest.skip(f"scontrol show hostnames failed: {done.stderr.strip()}")
    assert list(expand(text)) == done.stdout.split()
