#!/bin/sh
# Install nantrace from this unpacked tarball (see share/doc/nantrace or docs/dist.md):
#   bin/nantrace                              -> /usr/local/bin/nantrace            0755
#   lib/systemd/system/nantrace-agent.service -> /etc/systemd/system/               0644
#   etc/nantrace/agent.toml (if shipped)      -> /etc/nantrace/agent.toml           0600
#                                                never overwritten: an existing one is kept and
#                                                the shipped one goes next to it as agent.toml.dist
#   share/doc/nantrace/*                      -> /usr/local/share/doc/nantrace/     0644
# Run as root:  sudo ./install.sh
# DESTDIR=/some/dir ./install.sh installs under that directory instead (packaging, tests).
set -eu

cd "$(dirname "$0")"
D=${DESTDIR:-}
if [ -z "$D" ] && [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root (or set DESTDIR)" >&2
    exit 1
fi
for f in bin/nantrace lib/systemd/system/nantrace-agent.service; do
    [ -f "$f" ] || { echo "install.sh: $f missing: run me from the unpacked tarball" >&2; exit 1; }
done

say() { echo "install.sh: $*"; }

install -d -m 0755 "$D/usr/local/bin" "$D/etc/systemd/system"
install -m 0755 bin/nantrace "$D/usr/local/bin/nantrace"
say "installed $D/usr/local/bin/nantrace ($("$D/usr/local/bin/nantrace" --version 2>&1 || echo 'does not run here!'))"
install -m 0644 lib/systemd/system/nantrace-agent.service "$D/etc/systemd/system/nantrace-agent.service"
say "installed $D/etc/systemd/system/nantrace-agent.service"

[ -d "$D/etc/nantrace" ] || install -d -m 0755 "$D/etc/nantrace"
if [ -f etc/nantrace/agent.toml ]; then
    if [ -e "$D/etc/nantrace/agent.toml" ]; then
        install -m 0600 etc/nantrace/agent.toml "$D/etc/nantrace/agent.toml.dist"
        say "kept the existing $D/etc/nantrace/agent.toml; this release's default is $D/etc/nantrace/agent.toml.dist"
    else
        install -m 0600 etc/nantrace/agent.toml "$D/etc/nantrace/agent.toml"
        say "installed $D/etc/nantrace/agent.toml (edit it before starting the agent)"
    fi
elif [ ! -e "$D/etc/nantrace/agent.toml" ]; then
    say "NOTE: this tarball ships no agent.toml and $D/etc/nantrace/agent.toml does not exist: write one before starting the agent"
fi

if [ -d share/doc/nantrace ]; then
    install -d -m 0755 "$D/usr/local/share/doc/nantrace"
    for f in share/doc/nantrace/*; do
        [ -f "$f" ] && install -m 0644 "$f" "$D/usr/local/share/doc/nantrace/"
    done
    say "installed the docs in $D/usr/local/share/doc/nantrace"
fi

if ! "$D/usr/local/bin/nantrace" agent --help >/dev/null 2>&1; then
    say "WARNING: this nantrace has no 'agent' subcommand: nantrace-agent.service will fail to start until a release that has it is installed"
fi
echo
echo "Now enable and start the agent:"
echo "  systemctl daemon-reload && systemctl enable --now nantrace-agent"
