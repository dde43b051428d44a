// One RDMA NIC port in use (a "rail"): its verbs context, protection domain,
// the GID and MTU QPs use on it, and the device limits the data path obeys.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/rdma/verbs_loader.h"

namespace mori_torch {
namespace rdma {

struct RdmaDevice {
  RdmaDevice() = default;
  RdmaDevice(const RdmaDevice&) = delete;
  RdmaDevice& operator=(const RdmaDevice&) = delete;
  ~RdmaDevice();

  const VerbsApi* api = nullptr;
  std::string name;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  uint8_t port = 1;
  bool roce = false;  // Ethernet link layer: addressing by GID (GRH), not LID
  uint16_t lid = 0;
  int gid_index = 0;
  ibv_gid gid{};
  ibv_mtu active_mtu = IBV_MTU_1024;
  uint64_t max_msg_bytes = 1u << 30;
  int max_qp_wr = 0;
  int max_cqe = 0;
  int max_rd_atomic = 1;
};

// Which devices to use, as MORI reads them: "a,b" uses a then b (rail
// order), "^a,b" every device but a and b, empty every device (rails in name
// order, the same on every engine of a host).
struct DeviceFilter {
  bool exclude = false;
  std::vector<std::string> names;
  std::string source;  // the variable it came from, for messages
};
DeviceFilter ParseDeviceFilter(const std::string& spec, std::string source);
// From env MORI_TORCH_RDMA_DEVICES, else MORI's MORI_RDMA_DEVICES, else
// MORI_RDMA_DEVICE (mori_torch's earlier name).
DeviceFilter DeviceFilterFromEnv();
// Of the devices `present` (libibverbs' order), the ones to open, in rail
// order; those left out by the filter are appended to *filtered and names
// asked for but absent to *missing (" name (why)" each).
std::vector<std::string> SelectDevices(const DeviceFilter& f, std::vector<std::string> present, std::string* filtered,
                                       std::string* missing);

// Opens the first active port of every selected device (DeviceFilterFromEnv)
// and picks its GID: `gid_index` >= 0, else env MORI_TORCH_RDMA_GID_INDEX,
// MORI's MORI_IB_GID_INDEX or MORI_RDMA_GID_INDEX, else the IPv4-mapped RoCE
// v2 GID (index 0 on InfiniBand). Throws Error with "no active RDMA
// device/port found" and the reason when there is none.
std::vector<std::shared_ptr<RdmaDevice>> OpenActiveDevices(const VerbsApi* api, int64_t gid_index);

// "fe80::..." style text of a GID, for messages.
std::string GidText(const ibv_gid& gid);

}  // namespace rdma
}  // namespace mori_torch
