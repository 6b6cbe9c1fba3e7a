#pragma once
// Library version string. Placeholder written with the build set-up so that the
// shared library always has at least one translation unit.

namespace halfgrad {

// Returns the version of the halfgrad library, e.g. "0.1.0".
const char* version();

}  // namespace halfgrad
