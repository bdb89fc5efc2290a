"""Settings read the same everywhere: one source (the fields of ``stager.core.settings``)
for the flags of ``stager``, their environment variables and the docs' table."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from stager import cli
from stager.core.settings import (
    Settings,
    _Environment,
    commands_of,
    describe_error,
    env_name,
    environment_warnings,
    flag_name,
    format_size,
    is_list,
    is_size,
    settings_table,
)

REPO = Path(__file__).resolve().parents[2]
SETTINGS_DOC = REPO / "docs" / "settings.md"


def from_env(env: dict[str, str], **flags: object) -> Settings:
    """Settings as the daemon builds them, with ``env`` as its whole environment."""

    class Isolated(Settings):
        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, **rest):  # type: ignore[override]
            return init_settings, _Environment(settings_cls, env)

    return Isolated(**flags)


def sample(name: str) -> tuple[str, object]:
    """A value of field ``name`` as text, and what the field should read from it."""
    field = Settings.model_fields[name]
    if field.annotation is bool:
        return "true", True
    if is_size(name):
        return "12G", 12_000_000_000
    if is_list(name):
        # Folders that exist: an allowed root that does not is refused.
        return "/usr,/etc" if "roots" in name or "dirs" in name else "x.y,z", None
    if field.annotation is int:
        return "3", 3
    if field.annotation is float:
        return "7.5", 7.5
    return "", None


def serve_options() -> dict[str, argparse.Action]:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    return {option: action for action in serve._actions for option in action.option_strings}


def test_every_flag_has_the_environment_variable_of_its_name() -> None:
    """For each flag of `stager serve`: STAGER_<FLAG> sets the same field to the same
    value as the flag. (On 989b0ea --user-quota read STAGER_USER_QUOTA_BYTES.)"""
    options = serve_options()
    checked = 0
    for name in Settings.model_fields:
        if "serve" not in commands_of(name):
            continue
        flag = f"--{flag_name(name)}"
        assert flag in options and options[flag].dest == name, flag
        assert env_name(name) == "STAGER_" + flag[2:].replace("-", "_").upper()
        text, expected = sample(name)
        if not text:
            continue
        by_env = getattr(from_env({env_name(name): text}), name)
        args = cli.build_parser().parse_args(["serve", flag, text] if text != "true" else
                                             ["serve", flag])  # fmt: skip
        by_flag = getattr(from_env({}, **cli.given_flags(args)), name)
        assert by_env == by_flag, (flag, by_env, by_flag)
        if expected is not None:
            assert by_env == expected, flag
        checked += 1
    assert checked >= 12


def test_the_renamed_variables_are_read_and_their_old_names_still_work_with_a_warning() -> None:
    assert from_env({"STAGER_USER_QUOTA": "123"}).user_quota_bytes == 123
    assert from_env({"STAGER_STALL_TIMEOUT": "4"}).stall_timeout_s == 4
    assert from_env({"STAGER_CANCEL_GRACE": "2"}).cancel_grace_s == 2
    old = {"STAGER_USER_QUOTA_BYTES": "5G", "STAGER_CANCEL_GRACE_S": "1"}
    assert from_env(old).user_quota_bytes == 5_000_000_000
    assert environment_warnings(old) == [
        "STAGER_CANCEL_GRACE_S is the old name of STAGER_CANCEL_GRACE; rename it",
        "STAGER_USER_QUOTA_BYTES is the old name of STAGER_USER_QUOTA; rename it",
    ]
    # The new name wins, and the warning says the old one is ignored.
    both = {"STAGER_USER_QUOTA": "1G", "STAGER_USER_QUOTA_BYTES": "5G"}
    assert from_env(both).user_quota_bytes == 1_000_000_000
    assert "is ignored" in environment_warnings(both)[0]


def test_a_near_miss_of_a_settings_name_is_warned_about() -> None:
    warnings = environment_warnings({"STAGER_CAPACITY": "10G", "STAGER_URL": "unix:///x"})
    assert warnings == [
        "STAGER_CAPACITY is not a setting and is ignored; did you mean STAGER_CAPACITY_BYTES?"
    ]


def test_lists_take_commas_and_json_still_works() -> None:
    assert from_env({"STAGER_ALLOWED_ROOTS": "/usr"}).allowed_roots == [Path("/usr")]
    assert from_env({"STAGER_ALLOWED_ROOTS": "/usr, /etc"}).allowed_roots == [
        Path("/usr"),
        Path("/etc"),
    ]
    assert from_env({"STAGER_OP_MODULES": '["a.b", "c"]'}).op_modules == ["a.b", "c"]
    args = cli.build_parser().parse_args(
        ["serve", "--allowed-root", "/usr,/etc", "--allowed-roots", "/var"]
    )
    assert from_env({}, **cli.given_flags(args)).allowed_roots == [
        Path(p) for p in "/usr /etc /var".split()
    ]


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("10G", 10**10), ("500M", 500 * 10**6), ("1.5TiB", int(1.5 * 2**40)), ("4096", 4096)],
)
def test_sizes_take_units(text: str, nbytes: int) -> None:
    assert from_env({"STAGER_CAPACITY_BYTES": text}).capacity_bytes == nbytes
    args = cli.build_parser().parse_args(["serve", "--capacity-bytes", text])
    assert from_env({}, **cli.given_flags(args)).capacity_bytes == nbytes


def test_a_bad_value_is_one_sentence_naming_where_it_came_from() -> None:
    with pytest.raises(ValidationError) as flagged:
        from_env({}, capacity_bytes="10X")
    assert describe_error(flagged.value, {"capacity_bytes": "10X"}) == (
        "--capacity-bytes: '10X' is not a size; give bytes or a number with a unit, "
        "e.g. 10G, 500M, 1.5TiB"
    )
    with pytest.raises(ValidationError) as from_environment:
        from_env({"STAGER_MAX_WORKERS": "many"})
    sentence = describe_error(from_environment.value, {})
    assert sentence.startswith("STAGER_MAX_WORKERS 'many': "), sentence


def test_sizes_print_human_readable() -> None:
    assert format_size(161597160) == "154.1 MiB"
    assert format_size(0) == "0 B"


def test_the_docs_settings_table_is_the_one_the_fields_make() -> None:
    doc = SETTINGS_DOC.read_text()
    block = re.search(r"<!-- settings-table.*?-->\n(.*?)<!-- end of settings-table", doc, re.S)
    assert block, "docs/settings.md lost its generated table's markers"
    assert block.group(1) == settings_table(), (
        "docs/settings.md's table is stale: regenerate it with `python -m stager.core.settings`"
    )
    for name in Settings.model_fields:  # every variable is in it, with its flag
        assert f"`{env_name(name)}`" in block.group(1)
        if commands_of(name):
            assert f"`--{flag_name(name)}` | `{env_name(name)}`" in block.group(1)


def test_every_flag_and_variable_pair_the_docs_write_agrees_with_the_fields() -> None:
    """Prose such as "`--user-quota BYTES` (`STAGER_USER_QUOTA_BYTES`)" pairs a flag
    with a variable: each such pair must be the field's."""
    by_flag = {f"--{flag_name(n)}": env_name(n) for n in Settings.model_fields}
    pairs = re.compile(r"`(--[a-z-]+)[^`]*`\s*(?:/|\(|or)\s*`(STAGER_[A-Z_]+)")
    wrong = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for flag, env in pairs.findall(doc.read_text()):
            if flag in by_flag and by_flag[flag] != env:
                wrong.append(f"{doc.name}: {flag} is {by_flag[flag]}, not {env}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "trusted",
    ["{cache}", "{cache}/data", "{cache}/..", "{link}"],
    ids=["the-cache", "inside-it", "around-it", "a-link-to-it"],
)
def test_a_trusted_image_folder_that_overlaps_the_cache_is_refused(
    trusted: str, tmp_path: Path
) -> None:
    """The service writes users' staged files in the cache as root's: a trusted folder
    there would pass them for an admin's images and mount them in the kernel."""
    cache = tmp_path / "cache"
    (cache / "data").mkdir(parents=True)
    (tmp_path / "link").symlink_to(cache / "data")
    folder = trusted.format(cache=cache, link=tmp_path / "link")
    env = {"STAGER_CACHE_DIR": str(cache), "STAGER_TRUSTED_IMAGE_DIRS": folder}
    with pytest.raises(ValidationError) as caught:
        from_env(env)
    message = describe_error(caught.value, {})
    assert f"trusted image folder {folder} overlaps the cache folder" in message, message
    assert "outside the cache" in message
    from_env({**env, "STAGER_TRUSTED_IMAGE_DIRS": str(tmp_path / "images")})  # apart: fine


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("prefetch_listen", "0.0.0.0:8766", "STAGER_PREFETCH_LISTEN (--prefetch-listen)"),
        ("plan_node_port", 1024, "STAGER_PLAN_NODE_PORT (--plan-node-port)"),
        ("plan_node_addresses", ["n1=10.0.0.1:8766"], "STAGER_PLAN_NODE_ADDRESSES n1="),
    ],
)
def test_the_prefetch_port_must_be_privileged(field: str, value: object, says: str) -> None:
    """A port a user may bind could be theirs while the node service restarts."""
    with pytest.raises(ValueError, match="below 1024") as raised:
        Settings(**{field: value})
    assert says in str(raised.value) and "e.g. 866" in str(raised.value)
    assert Settings(prefetch_listen="0.0.0.0:866", plan_node_port=866).plan_node_port == 866
