#include "core/version.h"

namespace halfgrad {

const char* version() { return "0.1.0"; }

}  // namespace halfgrad
