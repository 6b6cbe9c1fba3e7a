#!/usr/bin/env bash
# Copies halfgrad's C++ build dependencies (Eigen, fmt, spdlog, doctest, CLI11, nlohmann-json: headers, CMake package
# files and the two shared libraries) from this machine into .deps/usr, for a machine that has CUDA but not
# these packages and cannot download them (the lent GPU machine). tools/gpu_check.sh finds them there.
#
#   tools/pack_gpu_deps.sh        # on a Debian/Ubuntu machine where `make deps` has installed them
#   run: carry [".deps"], command "bash tools/gpu_check.sh"
#
# The folder is about 13 MB and must not be committed (.deps/ is git-ignored).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

packages=(libeigen3-dev libfmt-dev libspdlog-dev doctest-dev libcli11-dev nlohmann-json3-dev)
# The runtime libraries: libfmt9 / libspdlog1.10 on Debian 12; whatever the -dev packages depend on elsewhere.
for dev in libfmt-dev libspdlog-dev; do
  while read -r dep; do
    [[ -n $dep ]] && packages+=("$dep")
  done < <(dpkg-query -W -f='${Depends}\n' "$dev" | tr ',' '\n' | sed -E 's/^ *([^ :]+).*/\1/' |
           grep -E '^lib(fmt|spdlog)[0-9]' || true)
done

rm -rf .deps
mkdir -p .deps
for pkg in "${packages[@]}"; do
  dpkg-query -W "$pkg" >/dev/null 2>&1 || { echo "pack_gpu_deps: $pkg is not installed (run make deps)" >&2; exit 1; }
  dpkg -L "$pkg" | grep -E '^/usr/(include|lib|share/(eigen3|cmake))' | while read -r f; do
    [[ -f $f || -L $f ]] || continue
    mkdir -p ".deps$(dirname "$f")"
    cp -a "$f" ".deps$f"
  done
done

# Some package files name the prefix /usr outright; make them relative to where they are now.
for f in .deps/usr/lib/cmake/doctest/doctestTargets.cmake .deps/usr/share/cmake/CLI11/CLI11Config.cmake; do
  [[ -f $f ]] && sed -i 's|set(_IMPORT_PREFIX "/usr")|get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)|' "$f"
done

grep -qxF '/.deps/' .git/info/exclude 2>/dev/null || echo '/.deps/' >> .git/info/exclude
echo "pack_gpu_deps: $(du -sh .deps | cut -f1) in .deps (${packages[*]})"
