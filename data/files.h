#pragma once
// The data readers' one rule for a path they are given (data/cifar.cpp, data/text.cpp).
#include <filesystem>

namespace halfgrad::data {

// Whether a regular file is at `path`: false where nothing is; an error naming `what` and the path where something
// else is (a folder, a FIFO, a device), which a reader would misread, or wait on for a writer that never comes, and
// where the path's status cannot be read (a loop of links, a folder on the way it may not search), with the reason.
bool regular_file_at(const std::filesystem::path& path, const char* what);

}  // namespace halfgrad::data
