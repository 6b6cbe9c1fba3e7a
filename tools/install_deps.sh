#!/usr/bin/env bash
# Installs halfgrad's build dependencies on Debian/Ubuntu, skipping whatever is already present.
# When nothing is missing it does not touch apt at all (machines without a package registry).
set -euo pipefail

missing=()     # Debian packages to install
describe=()    # what is missing, for messages

need_file() {  # need_file PACKAGE FILE...: present if any FILE exists
  local pkg=$1; shift
  local f
  for f in "$@"; do
    [[ -e $f ]] && return 0
  done
  missing+=("$pkg"); describe+=("$pkg ($1)")
}

need_cmd() {   # need_cmd PACKAGE COMMAND
  if ! command -v "$2" >/dev/null 2>&1; then
    missing+=("$1"); describe+=("$1 ($2)")
  fi
}

multiarch=$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)

need_file libeigen3-dev  /usr/include/eigen3/Eigen/Core /usr/local/include/eigen3/Eigen/Core
need_file libfmt-dev     /usr/include/fmt/format.h /usr/local/include/fmt/format.h
need_file libspdlog-dev  /usr/include/spdlog/spdlog.h /usr/local/include/spdlog/spdlog.h
need_file doctest-dev    /usr/include/doctest/doctest.h /usr/local/include/doctest/doctest.h
need_file libcli11-dev   /usr/include/CLI/CLI.hpp /usr/local/include/CLI/CLI.hpp
need_file nlohmann-json3-dev /usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake \
          /usr/local/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake
# The CMake package files matter too (find_package); the headers alone are not enough.
need_file libfmt-dev     "/usr/lib/$multiarch/cmake/fmt/fmt-config.cmake" /usr/local/lib/cmake/fmt/fmt-config.cmake
need_file libspdlog-dev  "/usr/lib/$multiarch/cmake/spdlog/spdlogConfig.cmake" /usr/local/lib/cmake/spdlog/spdlogConfig.cmake
need_cmd  cmake          cmake
need_cmd  g++            g++
need_cmd  make           make
need_cmd  ninja-build    ninja   # optional: the Makefile falls back to Unix Makefiles

# A package can be listed twice (header and CMake config); keep one of each.
if ((${#missing[@]})); then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
fi

# halfgrad needs CMake >= 3.24; some distributions (Ubuntu 22.04) ship an older one.
check_cmake_version() {
  command -v cmake >/dev/null 2>&1 || return 0
  local v
  v=$(cmake --version | sed -n '1s/^cmake version \([0-9][0-9.]*\).*/\1/p')
  if [[ -n $v ]] && [[ $(printf '%s\n' 3.24 "$v" | sort -V | head -n1) != 3.24 ]]; then
    echo "install_deps: warning: cmake $v is older than the 3.24 halfgrad needs (try: pip install cmake)" >&2
  fi
}

# Optional: matplotlib, for tools/plot.py's figures (its test is skipped without it). Installed where apt can; a
# machine without a package registry (the GPU machine) goes on without it.
optional=()
if ! python3 -c 'import matplotlib' >/dev/null 2>&1 && [[ ! -e /usr/lib/python3/dist-packages/matplotlib/__init__.py ]]; then
  optional+=(python3-matplotlib)
fi
# Optional too: Gloo, for the process groups of dist/ (built and tested where it is present; CMake says so).
if [[ ! -e /usr/share/cmake/Gloo/GlooConfig.cmake && ! -e /usr/local/share/cmake/Gloo/GlooConfig.cmake ]]; then
  optional+=(libgloo-dev)
fi

sudo=()
if ((EUID != 0)) && command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
fi
can_install() { command -v apt-get >/dev/null 2>&1 && { ((EUID == 0)) || ((${#sudo[@]})); }; }
export DEBIAN_FRONTEND=noninteractive

install_optional() {
  ((${#optional[@]})) || return 0
  if can_install && { ((updated)) || "${sudo[@]}" apt-get update >/dev/null 2>&1; } &&
     "${sudo[@]}" apt-get install -y --no-install-recommends "${optional[@]}" >/dev/null 2>&1; then
    echo "install_deps: installed (optional) ${optional[*]}"
  else
    echo "install_deps: note: could not install the optional ${optional[*]} (python3-matplotlib: tools/plot.py's" \
         "figures, its test is skipped; libgloo-dev: dist/'s process groups, not built)"
  fi
}
updated=0

if ((${#missing[@]} == 0)); then
  check_cmake_version
  echo "install_deps: all build dependencies are present"
  install_optional
  exit 0
fi

echo "install_deps: missing: ${describe[*]}"

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_deps: error: apt-get is not available; install these packages by hand: ${missing[*]}" >&2
  exit 1
fi
if ! can_install; then
  echo "install_deps: error: not root and sudo is not available; install these packages as root: ${missing[*]}" >&2
  exit 1
fi

if ! "${sudo[@]}" apt-get update; then
  echo "install_deps: error: apt-get update failed; install these packages by hand: ${missing[*]}" >&2
  exit 1
fi
updated=1
if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; then
  echo "install_deps: error: apt-get install failed for: ${missing[*]}" >&2
  exit 1
fi
echo "install_deps: installed ${missing[*]}"
install_optional
check_cmake_version
