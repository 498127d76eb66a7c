#!/usr/bin/env bash
# Best-effort system packages: bubblewrap and a Docker daemon for the sandbox tests, Chromium
# for the dashboard test.
# Only as root with apt-get; otherwise (or if anything fails) those tests skip with a reason.
set -u
[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || exit 0
if ! command -v bwrap >/dev/null 2>&1 || ! command -v dockerd >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends bubblewrap docker.io) >/tmp/miles-apt.log 2>&1 \
        || echo "setup_system: apt-get failed (see /tmp/miles-apt.log); bwrap/docker tests will skip"
fi
if ! command -v chromium >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends chromium) >/tmp/miles-apt-chromium.log 2>&1 \
        || echo "setup_system: apt-get chromium failed (see /tmp/miles-apt-chromium.log)"
fi
if command -v dockerd >/dev/null 2>&1 && ! docker info >/dev/null 2>&1; then
    (dockerd >/tmp/miles-dockerd.log 2>&1 &)
    for _ in $(seq 30); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
exit 0
