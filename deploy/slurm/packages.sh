# shellcheck shell=bash
# Sourced by the test clusters' up.sh (local-cluster, multinode): install Debian
# packages when a tool they need is missing. CI starts from a bare machine.

# apt_install_missing "TOOL..." PACKAGE...   (a TOOL starting with / is a path)
apt_install_missing() {
    local tools=$1 tool missing=0
    shift
    for tool in $tools; do
        if [[ $tool == /* ]]; then
            [[ -x $tool ]] || missing=1
        else
            command -v "$tool" >/dev/null || missing=1
        fi
    done
    ((missing)) || return 0
    printf '%s: installing %s\n' "${0##*/}" "$*"
    export DEBIAN_FRONTEND=noninteractive
    # Fresh machines have empty package lists (apt may keep them compressed): refresh
    # only then, or again when an install fails on stale lists.
    if ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; then
        apt-get update -qq
    fi
    if ! apt-get install -y -qq --no-install-recommends "$@" >/dev/null; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "$@" >/dev/null
    fi
}
