#!/usr/bin/env bash
# Chromium and its WebDriver for the page's browser tests (tests/integration/test_page.py), from
# Debian's packages. Best effort: without them those tests skip and say why.
set -u
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  echo "Chromium: present"; exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "Chromium: installing Debian's chromium and chromium-driver"
  export DEBIAN_FRONTEND=noninteractive
  pkgs="chromium chromium-driver"
  (apt-get install -y -qq --no-install-recommends $pkgs >/dev/null 2>&1 || \
   (apt-get update -qq >/dev/null 2>&1 && \
    apt-get install -y -qq --no-install-recommends $pkgs >/dev/null 2>&1)) \
    && { echo "Chromium: installed"; exit 0; }
fi
echo "WARNING: no Chromium and chromedriver; the page's browser tests will skip." >&2
echo "         Install them with: sudo apt-get install chromium chromium-driver" >&2
exit 0
