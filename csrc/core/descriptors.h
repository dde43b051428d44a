// EngineDesc and MemoryDesc: what peers exchange (over ZMQ in vLLM/SGLang) to
// reach each other's engines and memory. pack()/unpack() carry a magic and a
// format version and reject anything malformed.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/types.h"

namespace mori_torch {

// 2: engine incarnation ids and memory tokens (version 1 descriptors carry
// neither, and are refused).
constexpr uint16_t kDescriptorFormatVersion = 2;
constexpr size_t kIpcHandleBytes = 64;
constexpr size_t kMemoryTokenBytes = 16;
// The capability a MemoryDesc carries: random per registration (CSPRNG), so
// a memory can only be reached by those it was handed to.
using MemoryToken = std::array<uint8_t, kMemoryTokenBytes>;
// Random per engine process: requests built from descriptors of an earlier
// process under the same key are told "engine restarted".
using Incarnation = uint64_t;

struct EngineDesc {
  std::string key;
  std::string node_id;
  std::string hostname;
  std::string host;
  int32_t port = 0;
  int32_t pid = 0;
  Incarnation incarnation = 0;

  std::vector<uint8_t> Pack() const;
  static EngineDesc Unpack(const uint8_t* data, size_t size);
  bool operator==(const EngineDesc& o) const;
  bool operator!=(const EngineDesc& o) const { return !(*this == o); }
};

struct MemoryDesc {
  std::string engine_key;
  MemoryId id = 0;
  int32_t device_id = -1;
  std::string device_bus_id;  // lower-case PCI id for GPU memory, "" for CPU
  uint64_t data = 0;          // address of the registered range
  uint64_t size = 0;
  MemoryLocationType loc = MemoryLocationType::Unknown;
  std::array<uint8_t, kIpcHandleBytes> ipc_handle{};  // of the allocation base
  uint64_t ipc_offset = 0;                            // offset of `data` inside that allocation
  int32_t numa_node = -1;
  Incarnation incarnation = 0;  // of the owning engine
  MemoryToken token{};          // checked by the owner on every access

  std::vector<uint8_t> Pack() const;
  static MemoryDesc Unpack(const uint8_t* data, size_t size);
  bool operator==(const MemoryDesc& o) const;
  bool operator!=(const MemoryDesc& o) const { return !(*this == o); }
};

// Node identity: MORI_TORCH_NODE_ID (or MORI_IO_NODE_ID), else the boot id,
// else the hostname.
std::string DefaultNodeId();
std::string LocalHostname();

}  // namespace mori_torch
