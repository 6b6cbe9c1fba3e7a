#!/usr/bin/env python3
"""Checks that halfgrad's safetensors files and Python's are the same format, in both directions.

    python3 tools/check_safetensors.py [--tests build/halfgrad_tests] [--keep DIR]

1. Runs the test program with HALFGRAD_SAFETENSORS_SAMPLE set, so that halfgrad writes a file of known
   contents (tests/test_checkpoint.cpp, sample_tensors(): every dtype, values exact in each).
2. Reads it with a reader written here from the format's description, using the standard library only:
   header length, JSON, contiguous data offsets, values. This part always runs.
3. Where Python's `safetensors` is importable: reads it with safe_open (numpy; bfloat16, which numpy lacks,
   is left out) and, where PyTorch is importable too, with safetensors.torch.load_file, and checks that
   safetensors.torch.save() of what it read gives back halfgrad's file byte for byte.
4. Where `safetensors` and numpy are importable: writes a file with safetensors.numpy.save_file and runs the
   test program with HALFGRAD_SAFETENSORS_FROM_PYTHON set, so that halfgrad reads Python's file and compares
   it bit for bit with the same tensors made in C++.

Steps 3 and 4 are skipped, with a message, when the modules are missing. Exit status 0 when every check that
ran passed.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

# The contents of sample_tensors() in tests/test_checkpoint.cpp.
FLOATS = [i / 4 - 0.5 for i in range(6)]
EXPECTED = {
    "F64": ("F64", [2, 3], FLOATS),
    "F32": ("F32", [2, 3], FLOATS),
    "F16": ("F16", [2, 3], FLOATS),
    "BF16": ("BF16", [2, 3], FLOATS),
    "I64": ("I64", [2, 3], [i - 2 for i in range(6)]),
    "I32": ("I32", [2, 3], [i - 2 for i in range(6)]),
    "U8": ("U8", [2, 3], [0, 1, 2, 3, 254, 255]),
    "BOOL": ("BOOL", [2, 3], [True, False, True, False, False, True]),
    "scalar": ("F32", [], [3.25]),
}
METADATA = {"written_by": "halfgrad"}

FORMATS = {"F64": "d", "F32": "f", "F16": "e", "I64": "q", "I32": "i", "U8": "B", "BOOL": "?"}
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}

failures = []
passed = 0


def check(condition, what):
    global passed
    passed += bool(condition)
    if not condition:
        failures.append(what)
        print("FAIL:", what)


def decode(dtype, raw):
    if dtype == "BF16":  # the top half of a float32
        return [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]
    return list(struct.unpack("<%d%s" % (len(raw) // SIZES[dtype], FORMATS[dtype]), raw))


def read_with_stdlib(path):
    """An independent reader: the format as its README describes it."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    check(n % 8 == 0, "header length %d is a multiple of 8" % n)
    header_bytes = data[8:8 + n]
    check(header_bytes.rstrip(b" ") == header_bytes.rstrip(), "the header is padded with spaces")
    header = json.loads(header_bytes)
    check(header.get("__metadata__") == METADATA, "metadata %r" % header.get("__metadata__"))
    buffer = data[8 + n:]
    entries = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    position = 0
    for (begin, end), name in entries:
        check(begin == position, "%s starts where the previous tensor ended" % name)
        check(begin % SIZES[header[name]["dtype"]] == 0, "%s is aligned to its element size" % name)
        position = end
    check(position == len(buffer), "the tensors cover the data buffer exactly")
    check(set(k for k in header if k != "__metadata__") == set(EXPECTED), "tensor names")
    for name, (dtype, shape, values) in EXPECTED.items():
        info = header.get(name, {})
        check(info.get("dtype") == dtype, "%s dtype %r" % (name, info.get("dtype")))
        check(info.get("shape") == shape, "%s shape %r" % (name, info.get("shape")))
        begin, end = info.get("data_offsets", [0, 0])
        check(decode(dtype, buffer[begin:end]) == values, "%s values" % name)
    print("stdlib reader: %d tensors checked" % len(EXPECTED))
    return data


def read_with_safetensors(path, file_bytes):
    try:
        import numpy as np
        from safetensors import safe_open
    except ImportError as e:
        print("skipped the safetensors/numpy read: %s" % e)
        return
    with safe_open(path, framework="np") as f:
        check(f.metadata() == METADATA, "safetensors metadata %r" % f.metadata())
        for name, (dtype, shape, values) in EXPECTED.items():
            if dtype == "BF16":
                continue  # numpy has no bfloat16
            array = f.get_tensor(name)
            check(list(array.shape) == shape, "safetensors/numpy %s shape" % name)
            check(array.reshape(-1).tolist() == values, "safetensors/numpy %s values" % name)
    print("safetensors (numpy): read back")
    try:
        import torch
        from safetensors.torch import load_file, save
    except ImportError as e:
        print("skipped the PyTorch read: %s" % e)
        return
    tensors = load_file(path)
    for name, (dtype, shape, values) in EXPECTED.items():
        t = tensors[name]
        check(list(t.shape) == shape, "torch %s shape" % name)
        flat = t.reshape(-1)
        got = flat.float().tolist() if dtype in ("F16", "BF16") else flat.tolist()
        check(got == values, "torch %s values" % name)
    check(save(tensors, metadata=METADATA) == file_bytes,
          "safetensors.torch.save of what it read is byte-identical to halfgrad's file")
    print("safetensors (torch): read back, re-serialised byte-identically")


def write_with_python(path):
    try:
        import numpy as np
        from safetensors.numpy import save_file
    except ImportError as e:
        print("skipped writing a file with Python: %s" % e)
        return False
    dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "U8": np.uint8, "BOOL": np.bool_}
    arrays = {name: np.array(values, dtype=dtypes[dtype]).reshape(shape)
              for name, (dtype, shape, values) in EXPECTED.items() if dtype != "BF16"}
    save_file(arrays, path, metadata={"written_by": "python"})
    return True


def run_tests(binary, case, env):
    result = subprocess.run([binary, "-tc=" + case, "--success=false"], env={**os.environ, **env},
                            capture_output=True, text=True)
    print(result.stdout.strip().splitlines()[-3] if result.stdout.strip() else result.stderr)
    check(result.returncode == 0, "halfgrad_tests -tc=%r: %s" % (case, result.stdout + result.stderr))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", default="build/halfgrad_tests", help="the halfgrad_tests program")
    parser.add_argument("--keep", help="write the files here and keep them (default: a temporary directory)")
    args = parser.parse_args()
    if not os.path.exists(args.tests):
        sys.exit("no test program at %s: build first, or pass --tests" % args.tests)
    directory = args.keep or tempfile.mkdtemp(prefix="halfgrad_safetensors_")
    os.makedirs(directory, exist_ok=True)

    sample = os.path.join(directory, "from_halfgrad.safetensors")
    run_tests(args.tests, "*sample checkpoint for Python*", {"HALFGRAD_SAFETENSORS_SAMPLE": sample})
    file_bytes = read_with_stdlib(sample)
    read_with_safetensors(sample, file_bytes)

    from_python = os.path.join(directory, "from_python.safetensors")
    if write_with_python(from_python):
        run_tests(args.tests, "*written by Python*", {"HALFGRAD_SAFETENSORS_FROM_PYTHON": from_python})

    print("%d passed, %d failed" % (passed, len(failures)))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
