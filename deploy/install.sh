#!/usr/bin/env bash
# Install (or upgrade in place) stager's node service on this node, as root:
#
#   deploy/install.sh                      # /opt/stager, the unit enabled and started
#   deploy/install.sh --prefix /sw/stager  # elsewhere
#   deploy/install.sh --python /usr/local/bin/python3.12   # this interpreter
#   deploy/install.sh --planner            # on the controller: the pre-staging planner
#
# 1. the Debian packages it needs, when missing (python3.11 and its venv, munge for
#    multi-node jobs, curl and util-linux for the SLURM scripts);
# 2. a virtualenv in PREFIX/venv with this checkout's stager in it (the daemon and the
#    client; `pip install 'stager[train]'` there adds the trainer);
# 3. PREFIX/docs, and /etc/stager/stager.env from deploy/systemd/stager.env unless the
#    admin already has one (it is never overwritten);
# 4. the unit /etc/systemd/system/stager.service (its ExecStart pointing at PREFIX),
#    enabled and started where systemd runs; restarted on an upgrade, which stagings
#    under way survive (they resume). Without systemd it says how to start it.
#
# The interpreter (--python PATH, or PYTHON=PATH in the environment): every user runs
# the venv's programs, so it must be one every user can execute; it is tried as the
# user nobody. Default: python3.11 on PATH if users can run it, else Debian's
# /usr/bin/python3.11. One users cannot run, or older than stager supports, is refused.
#
# --planner installs the pre-staging planner (docs/prestaging.md) instead of the node
# service: steps 1-3 alike, then /etc/stager/plan.env (from deploy/systemd/stager-plan.env,
# never overwritten) and the unit stager-plan.service, enabled and started. For the
# controller, or a host with Slurm's client commands and the cluster's munged.
#
# Run it again to upgrade: the venv is reused and stager replaced in it; it is built
# afresh when its interpreter is another than the one chosen now. Idempotent.
# Options for tests and packagers: --etc DIR, --unit-dir DIR, --no-packages,
# --no-systemd.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
PREFIX=/opt/stager
ETC=/etc/stager
UNIT_DIR=/etc/systemd/system
PACKAGES=1
SYSTEMD=1
PYTHON=${PYTHON:-}
SERVICE=stager # the unit and its env file: stager.service and stager.env, or the planner's

usage() {
    sed -n '2,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

while (($#)); do
    case $1 in
    --prefix) PREFIX=$2; shift 2 ;;
    --python) PYTHON=$2; shift 2 ;;
    --etc) ETC=$2; shift 2 ;;
    --unit-dir) UNIT_DIR=$2; shift 2 ;;
    --no-packages) PACKAGES=0; shift ;;
    --no-systemd) SYSTEMD=0; shift ;;
    --planner) SERVICE=stager-plan; shift ;;
    -h | --help) usage 0 ;;
    *) echo "install.sh: unknown option $1; see --help" >&2; exit 2 ;;
    esac
done

say() { printf 'install.sh: %s\n' "$*"; }

if ((PACKAGES)); then
    # shellcheck source=slurm/packages.sh
    source "$HERE/slurm/packages.sh"
    tools="curl setpriv munged"
    [[ -n $PYTHON ]] || tools+=" /usr/bin/python3.11"
    apt_install_missing "$tools" python3.11 python3.11-venv curl util-linux munge
fi

# The oldest Python stager supports: pyproject.toml's requires-python (">=3.11").
MIN_PYTHON=$(sed -n 's/^requires-python *= *">=\([0-9.]*\)".*/\1/p' "$REPO/pyproject.toml")
MIN_PYTHON=${MIN_PYTHON:-3.11}

# "$@" as any user of the node may run it: the user nobody, no groups, a bare
# environment, from / (as root; otherwise as whoever runs this script).
as_a_user() {
    local -a bare=(env -i PATH=/usr/bin:/bin HOME=/ LANG=C.UTF-8)
    if ((EUID != 0)); then
        (cd / && "${bare[@]}" "$@")
    elif command -v setpriv >/dev/null; then
        (cd / && setpriv --reuid="$(id -u nobody)" --regid="$(id -g nobody)" --clear-groups \
            -- "${bare[@]}" "$@")
    else
        (cd / && runuser -u nobody -- "${bare[@]}" "$@")
    fi
}

version_at_least() { # $1 >= $2, both X.Y[.Z]
    [[ $(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1) == "$2" ]]
}

# Whether the interpreter $1 can be the venv's: users can run it and it is new enough.
# Sets CHOSEN (its sys.executable, the path the venv links to) and CHOSEN_VERSION, or
# WHY it cannot.
usable() {
    local path answer version executable
    if ! path=$(command -v "$1"); then
        WHY="there is no such program"
        return 1
    fi
    path=$(cd "$(dirname "$path")" && pwd)/$(basename "$path")
    if ! answer=$(as_a_user "$path" -c \
        'import sys; print("%d.%d.%d" % sys.version_info[:3], sys.executable)' 2>&1); then
        WHY="users cannot run it (as nobody: ${answer//$'\n'/ | })"
        return 1
    fi
    read -r version executable <<<"${answer##*$'\n'}"
    if [[ ! $version =~ ^[0-9]+\.[0-9]+\.[0-9]+$ || $executable != /* ]]; then
        WHY="it does not answer as a Python interpreter does (${answer//$'\n'/ | })"
        return 1
    fi
    if ! version_at_least "$version" "$MIN_PYTHON"; then
        WHY="it is Python $version, and stager needs $MIN_PYTHON or newer"
        return 1
    fi
    if ! trusted "$path" "$executable"; then
        return 1
    fi
    CHOSEN=$executable
    CHOSEN_VERSION=$version
}

# Whether the interpreter $1 (run as $2) is root's alone, as sshd's StrictModes asks of
# a key: the root daemon runs it, so whoever can write it, its standard library or a
# folder above either could run code as root. Checked: the paths it is named by and its
# real path, its prefix, libdir and standard library (all of its files), and every
# folder from / down to each. Sets WHY to the first that fails and how to fix it.
trusted() {
    local paths place found
    if ! paths=$(as_a_user "$1" -I -c 'import os, sys, sysconfig
print(os.path.realpath(sys.executable)); print(sys.base_prefix)
print(sysconfig.get_config_var("LIBDIR") or sys.base_prefix)
print(sysconfig.get_paths()["stdlib"]); print(sysconfig.get_paths()["platstdlib"])' 2>&1); then
        WHY="it does not say where its files are (${paths//$'\n'/ | })"
        return 1
    fi
    local -a places=("$1" "$2")
    mapfile -t -O 2 places <<<"$paths"
    for place in "${places[@]}"; do
        while true; do
            if ! root_only "$place"; then
                WHY="$place can be written by another than root ($(stat -c '%U:%G %A' -- "$place"));"
                WHY+=" make it and the folders above it root's and writable by root alone"
                WHY+=" (chown root:root, chmod go-w), or give another interpreter"
                return 1
            fi
            [[ $place == / || $place != /* ]] && break
            place=$(dirname "$place")
        done
    done
    for place in "${places[@]:5}"; do # the standard library's files
        found=$(find "$place" -xdev \( -name site-packages -o -name dist-packages \) -prune \
            -o ! -type l \( ! -uid 0 ! -uid "$EUID" -o -perm /022 \) -print -quit 2>&1)
        if [[ -n $found ]]; then
            WHY="${found%%$'\n'*} can be written by another than root; make $place root's"
            WHY+=" and writable by root alone (chown -R root:root, chmod -R go-w)"
            return 1
        fi
    done
}

# Whether $1 (not followed, if a link) is root's (or this script's user's) and
# writable by its owner alone; a link's own mode means nothing.
root_only() {
    local owner mode
    [[ -e $1 || -L $1 ]] || return 0 # absent: its folder, checked next, says who may make it
    read -r owner mode < <(stat -c '%u %a' -- "$1") || return 1
    ((owner == 0 || owner == EUID)) || return 1
    [[ -L $1 ]] || ((!(8#$mode & 8#022)))
}

CHOSEN=
if [[ -n $PYTHON ]]; then
    if ! usable "$PYTHON"; then
        echo "install.sh: refusing the interpreter $PYTHON (--python or PYTHON=): $WHY;" \
            "give one every user can execute and only root can write (e.g. /usr/bin/python3.11)" >&2
        exit 2
    fi
else
    on_path=$(command -v python3.11 || true)
    for candidate in $on_path /usr/bin/python3.11; do
        if usable "$candidate"; then
            break
        fi
        say "not using $candidate: $WHY"
    done
    if [[ -z $CHOSEN ]]; then
        echo "install.sh: no Python $MIN_PYTHON or newer that every user can execute;" \
            "install Debian's (apt-get install python3.11 python3.11-venv) or give one" \
            "with --python PATH" >&2
        exit 2
    fi
fi
say "using the interpreter $CHOSEN (Python $CHOSEN_VERSION), which every user can run"

# The interpreter the venv runs: bin/python's links, followed while they stay in bin/.
venv_interpreter() {
    local link=$VENV/bin/python target
    while [[ -L $link ]]; do
        target=$(readlink "$link")
        if [[ $target == /* ]]; then
            printf '%s\n' "$target"
            return
        fi
        link=$VENV/bin/$target
    done
    printf '%s\n' "$link"
}

VENV=$PREFIX/venv
if [[ -x $VENV/bin/python && $(venv_interpreter) == "$CHOSEN" ]]; then
    say "upgrading stager in $VENV (was $("$VENV/bin/stager" --version 2>/dev/null || echo unknown))"
    # Not editable: the service must not depend on this checkout staying where it is.
    "$VENV/bin/pip" install --progress-bar on --upgrade "$REPO"
else
    # Another interpreter (or a broken venv): a venv cannot change its interpreter in
    # place, so it is made afresh. The old one waits aside until the new one is whole
    # (a venv's scripts name their folder, so the new one is built where it will stay):
    # a failed build (pip offline) puts it back. A running service keeps its open files.
    rm -rf "$VENV.old"
    if [[ -e $VENV ]]; then
        say "rebuilding $VENV: it runs $(venv_interpreter), not $CHOSEN"
        mv "$VENV" "$VENV.old"
    else
        say "creating $VENV"
    fi
    mkdir -p "$PREFIX"
    if ! { "$CHOSEN" -m venv "$VENV" &&
        "$VENV/bin/pip" install --progress-bar on --upgrade pip &&
        "$VENV/bin/pip" install --progress-bar on --upgrade "$REPO"; }; then
        rm -rf "$VENV"
        if [[ -e $VENV.old ]]; then
            mv "$VENV.old" "$VENV"
            echo "install.sh: building the new venv failed (see above); $VENV is the one" \
                "it was, unchanged; fix the cause (pip's index?) and run this again" >&2
        else
            echo "install.sh: building $VENV failed (see above); fix the cause and run this" \
                "again" >&2
        fi
        exit 1
    fi
    rm -rf "$VENV.old"
fi
say "installed $("$VENV/bin/stager" --version)"
# What users run must run as a user: a prefix in a folder they cannot enter would not.
if ! answer=$(as_a_user "$VENV/bin/stager-client" --version 2>&1); then
    echo "install.sh: users cannot run $VENV/bin/stager-client (as nobody:" \
        "${answer//$'\n'/ | }); install into a prefix every user can enter (--prefix)" >&2
    exit 1
fi

rm -rf "$PREFIX/docs"
cp -r "$REPO/docs" "$PREFIX/docs"

install -d -m 0755 "$ETC"
# The node service's settings are stager.env; the planner's plan.env (one host may have both).
ENV_NAME=$([[ $SERVICE == stager ]] && echo stager.env || echo plan.env)
if [[ -e $ETC/$ENV_NAME ]]; then
    say "kept $ETC/$ENV_NAME (the example: $PREFIX/$ENV_NAME.example)"
else
    install -m 0644 "$HERE/systemd/$SERVICE.env" "$ETC/$ENV_NAME"
    if [[ $SERVICE == stager ]]; then
        say "wrote $ETC/$ENV_NAME: set the cache disk and its size there"
    else
        say "wrote $ETC/$ENV_NAME: set the interval (bf_interval) and the nodes' port there"
    fi
fi
install -m 0644 "$HERE/systemd/$SERVICE.env" "$PREFIX/$ENV_NAME.example"

UNIT=$SERVICE.service
install -d -m 0755 "$UNIT_DIR"
sed -e "s|/opt/stager|$PREFIX|g" -e "s|/etc/stager/|$ETC/|g" \
    "$HERE/systemd/$UNIT" >"$UNIT_DIR/$UNIT.new"
chmod 0644 "$UNIT_DIR/$UNIT.new"
mv "$UNIT_DIR/$UNIT.new" "$UNIT_DIR/$UNIT"
say "wrote $UNIT_DIR/$UNIT"

if ((SYSTEMD)) && [[ -d /run/systemd/system ]]; then
    systemctl daemon-reload
    systemctl enable "$UNIT"
    if systemctl is-active --quiet "$UNIT"; then
        systemctl restart "$UNIT"
        say "restarted $UNIT (stagings under way resume)"
    else
        systemctl start "$UNIT"
        say "started $UNIT; its log: journalctl -u $SERVICE"
    fi
else
    # The unit's own start, as systemd makes it: its Environment= lines, then its
    # EnvironmentFile= over them (when it exists), then ExecStart.
    unit=$UNIT_DIR/$UNIT
    environment=$(sed -n 's/^Environment=//p' "$unit" | tr '\n' ' ')
    env_file=$(sed -n 's/^EnvironmentFile=-\{0,1\}//p' "$unit")
    start=$(sed -n 's/^ExecStart=//p' "$unit")
    say "systemd does not run here: start the service as its unit does, with:"
    printf "  env %ssh -c 'set -a; if [ -r %s ]; then . %s; fi; exec %s'\n" \
        "$environment" "$env_file" "$env_file" "$start"
fi
