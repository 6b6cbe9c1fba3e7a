#pragma once
// Device dispatch: each op family declares one KernelTable per kernel signature; the CPU file and the CUDA
// file of the family each register their function for their device. An op calls table[device](...).
//
//   ops/elementwise.h   extern KernelTable<UnaryKernel> unary_kernel;
//   ops/elementwise.cpp HG_REGISTER_KERNEL(unary_kernel, CPU, unary_cpu);
//   ops/elementwise.cu  HG_REGISTER_KERNEL(unary_kernel, CUDA, unary_cuda);
//
// Tables are constant-initialised, so registration from static initialisers of any file is safe.
#include "core/device.h"
#include "core/error.h"

namespace halfgrad {

template <typename Fn> struct KernelTable {
  const char* name;
  Fn fns[kNumDeviceTypes] = {};

  constexpr explicit KernelTable(const char* n) : name(n) {}
  Fn operator[](Device d) const {
    Fn f = fns[int(d.type)];
    HG_CHECK(f != nullptr, "{}: no kernel for device {} (halfgrad was built without that backend)", name, d.str());
    return f;
  }
};

struct RegisterKernel {
  template <typename Fn> RegisterKernel(KernelTable<Fn>& table, DeviceType device, Fn fn) {
    table.fns[int(device)] = fn;
  }
};

#define HG_REGISTER_KERNEL(table, device, fn) \
  static ::halfgrad::RegisterKernel hg_register_##table##_##device(table, ::halfgrad::DeviceType::device, fn)

}  // namespace halfgrad
