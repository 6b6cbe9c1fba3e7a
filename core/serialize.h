#pragma once
// Tensors on disk in the safetensors format (https://github.com/huggingface/safetensors), so that Python's
// safetensors and PyTorch read what halfgrad writes, and the other way round:
//
//   bytes 0..7        N, the length of the JSON header, a little-endian uint64
//   bytes 8..8+N      the JSON header, padded with spaces to a multiple of 8 bytes:
//                       {"__metadata__": {"key": "value", ...},
//                        "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
//   bytes 8+N..       the data buffer: each tensor's elements, row-major, little-endian; data_offsets count
//                     from the start of this buffer, and the tensors cover it exactly (no holes, no overlap,
//                     nothing after the last one)
//
// The writer lays the file out exactly as the reference implementation (safetensors' Rust `serialize`, which
// Python's save_file calls) does, byte for byte: tensors ordered by dtype from the widest (I64, F64, F32, I32,
// BF16, F16, U8, BOOL: so every tensor's data is aligned to its element size when the buffer is) then by
// name, "__metadata__" first with its keys sorted, compact JSON. tests/test_checkpoint.cpp pins that layout
// against bytes taken from the reference implementation's own tests.
//
// Writes are atomic (write_file_atomic below): an existing file is replaced whole or not at all.
// Loading checks everything before it trusts anything: a corrupt or truncated file is a halfgrad::Error that
// names the file and the byte offset or tensor at fault, never a crash or a wild allocation.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace halfgrad {

// Tensors with names, in a meaningful order (a module's state, an optimizer's state).
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
// The "__metadata__" entry of a safetensors header: free-form strings.
using Metadata = std::map<std::string, std::string>;

struct SafetensorsContents {
  NamedTensors tensors;  // in the order of their data in the file; CPU tensors, contiguous, no grad
  Metadata metadata;

  // The tensor called `name`, or an undefined tensor.
  Tensor find(std::string_view name) const;
};

// Writes `tensors` (any device, any layout: they are copied to the host as contiguous bytes) and `metadata`
// to `path`, atomically. Names must be unique, non-empty and not "__metadata__"; every tensor defined.
void save_safetensors(const std::string& path, const NamedTensors& tensors, const Metadata& metadata = {});

// Reads and validates a whole file. Errors name the file and the byte offset / tensor at fault.
SafetensorsContents load_safetensors(const std::string& path);

// The bytes save_safetensors writes, in memory (for tests and for callers that ship bytes elsewhere).
std::string serialize_safetensors(const NamedTensors& tensors, const Metadata& metadata = {});

// safetensors' dtype names ("F32", "BF16", "BOOL", ...) and back; the parser errors on any other name.
const char* safetensors_dtype_name(DType dtype);

// ---- atomic file replacement (used by every checkpoint writer)
//
// Calls produce(write) to generate the contents, where write(data, size) appends bytes to a temporary file
// in the same directory as `path` (so the final rename cannot cross file systems). Then: fsync the file,
// rename it over `path` (atomic on POSIX), fsync the directory so the rename itself survives a power cut.
// If anything fails, including an exception thrown by `produce`, the temporary file is removed, `path` is
// left exactly as it was, and the error (a halfgrad::Error naming the file, the step and errno's message)
// propagates. A crash at any moment leaves either the old file or the new one, and at worst a stray
// "<path>.tmp-*" file. An existing file's permission bits are kept. A symbolic link is written through: the file it
// leads to is replaced, the link kept. Refused before `produce` runs: an empty path, a folder, a missing folder,
// and an existing file that is not a regular one (a FIFO, a device) or that this process may not write.
using WriteBytes = std::function<void(const void* data, size_t size)>;
void write_file_atomic(const std::string& path, const std::function<void(const WriteBytes& write)>& produce);

// Before a long run that will write `path` at its end: that write_file_atomic can create its temporary file there
// (the folder exists, is a folder, takes a new file) and that `path` passes write_file_atomic's checks; else an Error
// naming `what` (the option), the path and the reason. Leaves nothing behind.
void check_writable(const std::string& path, const char* what);

}  // namespace halfgrad
