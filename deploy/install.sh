#!/usr/bin/env bash
# Install (or upgrade in place) stager's node service on this node, as root:
#
#   deploy/install.sh                      # /opt/stager, the unit enabled and started
#   deploy/install.sh --prefix /sw/stager  # elsewhere
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
# Run it again to upgrade: the venv is reused and stager replaced in it. Idempotent.
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
PYTHON=${PYTHON:-python3.11}

usage() {
    sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

while (($#)); do
    case $1 in
    --prefix) PREFIX=$2; shift 2 ;;
    --etc) ETC=$2; shift 2 ;;
    --unit-dir) UNIT_DIR=$2; shift 2 ;;
    --no-packages) PACKAGES=0; shift ;;
    --no-systemd) SYSTEMD=0; shift ;;
    -h | --help) usage 0 ;;
    *) echo "install.sh: unknown option $1; see --help" >&2; exit 2 ;;
    esac
done

say() { printf 'install.sh: %s\n' "$*"; }

if ((PACKAGES)); then
    # shellcheck source=slurm/packages.sh
    source "$HERE/slurm/packages.sh"
    apt_install_missing "$PYTHON curl setpriv munged" \
        python3.11 python3.11-venv curl util-linux munge
fi

VENV=$PREFIX/venv
if [[ -x $VENV/bin/python ]]; then
    say "upgrading stager in $VENV (was $("$VENV/bin/stager" --version 2>/dev/null || echo unknown))"
else
    say "creating $VENV"
    mkdir -p "$PREFIX"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --progress-bar on --upgrade pip
fi
# Not editable: the service must not depend on this checkout staying where it is.
"$VENV/bin/pip" install --progress-bar on --upgrade "$REPO"
say "installed $("$VENV/bin/stager" --version)"

rm -rf "$PREFIX/docs"
cp -r "$REPO/docs" "$PREFIX/docs"

install -d -m 0755 "$ETC"
if [[ -e $ETC/stager.env ]]; then
    say "kept $ETC/stager.env (the example: $PREFIX/stager.env.example)"
else
    install -m 0644 "$HERE/systemd/stager.env" "$ETC/stager.env"
    say "wrote $ETC/stager.env: set the cache disk and its size there"
fi
install -m 0644 "$HERE/systemd/stager.env" "$PREFIX/stager.env.example"

install -d -m 0755 "$UNIT_DIR"
sed -e "s|/opt/stager|$PREFIX|g" -e "s|/etc/stager/|$ETC/|g" \
    "$HERE/systemd/stager.service" >"$UNIT_DIR/stager.service.new"
chmod 0644 "$UNIT_DIR/stager.service.new"
mv "$UNIT_DIR/stager.service.new" "$UNIT_DIR/stager.service"
say "wrote $UNIT_DIR/stager.service"

if ((SYSTEMD)) && [[ -d /run/systemd/system ]]; then
    systemctl daemon-reload
    systemctl enable stager.service
    if systemctl is-active --quiet stager.service; then
        systemctl restart stager.service
        say "restarted stager.service (stagings under way resume)"
    else
        systemctl start stager.service
        say "started stager.service; its log: journalctl -u stager"
    fi
else
    start=$(sed -n 's/^ExecStart=//p' "$UNIT_DIR/stager.service")
    say "systemd does not run here: start the service with: $start"
fi
