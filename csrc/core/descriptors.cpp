#include "core/descriptors.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "base/config_table.h"
#include "core/byte_io.h"

namespace mori_torch {
namespace {

constexpr uint32_t kEngineDescMagic = 0x4445544d;  // "MTED"
constexpr uint32_t kMemoryDescMagic = 0x444d544d;  // "MTMD"

void PutHeader(ByteWriter& w, uint32_t magic) {
  w.Put<uint32_t>(magic);
  w.Put<uint16_t>(kDescriptorFormatVersion);
}

void CheckHeader(ByteReader& r, uint32_t magic, const char* what) {
  uint32_t m = r.Get<uint32_t>("magic");
  if (m != magic) {
    char hex[16];
    snprintf(hex, sizeof hex, "%08x", m);
    throw Error(StatusCode::ERR_INVALID_ARGS,
                std::string(what) + ": bad magic 0x" + hex + " (not a mori_torch descriptor of this kind)");
  }
  uint16_t v = r.Get<uint16_t>("version");
  if (v != kDescriptorFormatVersion) {
    throw Error(StatusCode::ERR_INVALID_ARGS,
                std::string(what) + ": format version " + std::to_string(v) +
                    " is not supported (this build reads version " + std::to_string(kDescriptorFormatVersion) +
                    (v < kDescriptorFormatVersion
                         ? "; older descriptors carry no engine incarnation or memory token: re-publish them from "
                           "engines of this build)"
                         : ")"));
  }
}

}  // namespace

std::vector<uint8_t> EngineDesc::Pack() const {
  ByteWriter w;
  PutHeader(w, kEngineDescMagic);
  w.PutString(key);
  w.PutString(node_id);
  w.PutString(hostname);
  w.PutString(host);
  w.Put<int32_t>(port);
  w.Put<int32_t>(pid);
  w.Put<uint64_t>(incarnation);
  return std::move(w.bytes());
}

EngineDesc EngineDesc::Unpack(const uint8_t* data, size_t size) {
  ByteReader r(data, size, "EngineDesc.unpack");
  CheckHeader(r, kEngineDescMagic, "EngineDesc.unpack");
  EngineDesc d;
  d.key = r.GetString("key");
  d.node_id = r.GetString("node_id");
  d.hostname = r.GetString("hostname");
  d.host = r.GetString("host");
  d.port = r.Get<int32_t>("port");
  d.pid = r.Get<int32_t>("pid");
  d.incarnation = r.Get<uint64_t>("incarnation");
  r.ExpectEnd();
  if (d.port < 0 || d.port > 65535) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "EngineDesc.unpack: port " + std::to_string(d.port) + " out of range");
  }
  return d;
}

bool EngineDesc::operator==(const EngineDesc& o) const {
  return key == o.key && node_id == o.node_id && hostname == o.hostname && host == o.host && port == o.port &&
         pid == o.pid && incarnation == o.incarnation;
}

std::vector<uint8_t> MemoryDesc::Pack() const {
  ByteWriter w;
  PutHeader(w, kMemoryDescMagic);
  w.PutString(engine_key);
  w.Put<uint64_t>(id);
  w.Put<int32_t>(device_id);
  w.PutString(device_bus_id);
  w.Put<uint64_t>(data);
  w.Put<uint64_t>(size);
  w.Put<int32_t>(static_cast<int32_t>(loc));
  w.PutBytes(ipc_handle.data(), ipc_handle.size());
  w.Put<uint64_t>(ipc_offset);
  w.Put<int32_t>(numa_node);
  w.Put<uint64_t>(incarnation);
  w.PutBytes(token.data(), token.size());
  return std::move(w.bytes());
}

MemoryDesc MemoryDesc::Unpack(const uint8_t* data, size_t size) {
  ByteReader r(data, size, "MemoryDesc.unpack");
  CheckHeader(r, kMemoryDescMagic, "MemoryDesc.unpack");
  MemoryDesc d;
  d.engine_key = r.GetString("engine_key");
  d.id = r.Get<uint64_t>("id");
  d.device_id = r.Get<int32_t>("device_id");
  d.device_bus_id = r.GetString("device_bus_id", 64);
  d.data = r.Get<uint64_t>("data");
  d.size = r.Get<uint64_t>("size");
  int32_t loc = r.Get<int32_t>("loc");
  if (loc < 0 || loc > 2) {
    throw Error(StatusCode::ERR_INVALID_ARGS,
                "MemoryDesc.unpack: memory location " + std::to_string(loc) + " is not one of Unknown=0, CPU=1, GPU=2");
  }
  d.loc = static_cast<MemoryLocationType>(loc);
  r.GetBytes(d.ipc_handle.data(), d.ipc_handle.size(), "ipc_handle");
  d.ipc_offset = r.Get<uint64_t>("ipc_offset");
  d.numa_node = r.Get<int32_t>("numa_node");
  d.incarnation = r.Get<uint64_t>("incarnation");
  r.GetBytes(d.token.data(), d.token.size(), "token");
  r.ExpectEnd();
  if (d.data + d.size < d.data) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "MemoryDesc.unpack: address range overflows (data=" +
                                                  std::to_string(d.data) + ", size=" + std::to_string(d.size) + ")");
  }
  return d;
}

bool MemoryDesc::operator==(const MemoryDesc& o) const {
  return engine_key == o.engine_key && id == o.id && device_id == o.device_id && device_bus_id == o.device_bus_id &&
         data == o.data && size == o.size && loc == o.loc && ipc_handle == o.ipc_handle && ipc_offset == o.ipc_offset &&
         numa_node == o.numa_node && incarnation == o.incarnation && token == o.token;
}

std::string LocalHostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::string DefaultNodeId() {
  for (const char* var : {"MORI_TORCH_NODE_ID", "MORI_IO_NODE_ID"}) {
    std::string v = config::EnvText(var);
    if (!v.empty()) return v;
  }
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (f && std::getline(f, id) && !id.empty()) return id;
  return LocalHostname();
}

}  // namespace mori_torch
