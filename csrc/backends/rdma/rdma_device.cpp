#include "backends/rdma/rdma_device.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "base/config_table.h"
#include "core/logging.h"
#include "core/types.h"

namespace mori_torch {
namespace rdma {
namespace {

bool Ipv4Mapped(const ibv_gid& g) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(g.raw, prefix, sizeof prefix) == 0;
}

bool ZeroGid(const ibv_gid& g) {
  for (uint8_t b : g.raw) {
    if (b) return false;
  }
  return true;
}

// The kernel names each GID's type in sysfs ("RoCE v2", "IB/RoCE v1");
// "" when it cannot be read.
std::string GidType(const std::string& dev, int port, int index) {
  std::ifstream f("/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) + "/gid_attrs/types/" +
                  std::to_string(index));
  std::string t;
  std::getline(f, t);
  return t;
}

// The GID index to use on a RoCE port; -1 if none fits.
int PickRoceGid(const VerbsApi* api, RdmaDevice& d, int table_len) {
  int fallback = -1;
  for (int i = 0; i < table_len; ++i) {
    ibv_gid g{};
    if (api->query_gid(d.ctx, d.port, i, &g) != 0 || ZeroGid(g) || !Ipv4Mapped(g)) continue;
    const std::string type = GidType(d.name, d.port, i);
    if (type == "RoCE v2") return i;
    if (fallback < 0 && type.empty()) fallback = i;
  }
  return fallback;
}

}  // namespace

DeviceFilter ParseDeviceFilter(const std::string& spec, std::string source) {
  DeviceFilter f;
  f.source = std::move(source);
  std::string cur;
  size_t i = 0;
  if (!spec.empty() && spec[0] == '^') {
    f.exclude = true;
    i = 1;
  }
  for (; i <= spec.size(); ++i) {
    if (i == spec.size() || spec[i] == ',') {
      if (!cur.empty() && std::find(f.names.begin(), f.names.end(), cur) == f.names.end()) f.names.push_back(cur);
      cur.clear();
    } else if (spec[i] != ' ' && spec[i] != '\t') {
      cur += spec[i];
    }
  }
  return f;
}

DeviceFilter DeviceFilterFromEnv() {
  for (const char* env : {"MORI_TORCH_RDMA_DEVICES", "MORI_RDMA_DEVICES", "MORI_RDMA_DEVICE"}) {
    const std::string v = config::EnvText(env);
    if (!v.empty()) return ParseDeviceFilter(v, env);
  }
  return {};
}

std::vector<std::string> SelectDevices(const DeviceFilter& f, std::vector<std::string> present, std::string* filtered,
                                       std::string* missing) {
  auto listed = [&f](const std::string& n) { return std::find(f.names.begin(), f.names.end(), n) != f.names.end(); };
  auto here = [&present](const std::string& n) {
    return std::find(present.begin(), present.end(), n) != present.end();
  };
  std::vector<std::string> out;
  if (!f.names.empty() && !f.exclude) {
    for (const auto& n : f.names) {
      if (here(n)) {
        out.push_back(n);
      } else {
        *missing += " " + n + " (no such device)";
      }
    }
    for (const auto& n : present) {
      if (!listed(n)) *filtered += " " + n + " (not in " + f.source + ")";
    }
    return out;
  }
  std::sort(present.begin(), present.end());
  for (const auto& n : present) {
    if (f.exclude && listed(n)) {
      *filtered += " " + n + " (excluded by " + f.source + ")";
    } else {
      out.push_back(n);
    }
  }
  return out;
}

RdmaDevice::~RdmaDevice() {
  if (pd) api->dealloc_pd(pd);
  if (ctx) api->close_device(ctx);
}

std::string GidText(const ibv_gid& gid) {
  char b[48];
  const uint8_t* r = gid.raw;
  std::snprintf(b, sizeof b, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", r[0], r[1],
                r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12], r[13], r[14], r[15]);
  return b;
}

std::vector<std::shared_ptr<RdmaDevice>> OpenActiveDevices(const VerbsApi* api, int64_t gid_index) {
  const std::string none = "no active RDMA device/port found";
  std::string gid_from = "gid_index";  // where an explicit index came from, for messages
  if (gid_index < 0) {
    for (const char* env : {"MORI_TORCH_RDMA_GID_INDEX", "MORI_IB_GID_INDEX", "MORI_RDMA_GID_INDEX"}) {
      if (!config::EnvIsSet(env)) continue;
      gid_index = config::EnvInt(env);
      gid_from = env;
      break;
    }
  }
  const DeviceFilter filter = DeviceFilterFromEnv();
  int n = 0;
  errno = 0;
  ibv_device** list = api->get_device_list(&n);
  if (!list || n == 0) {
    const int e = errno;
    if (list) api->free_device_list(list);
    throw Error(StatusCode::ERR_BAD_STATE, none + ": libibverbs lists no RDMA devices" +
                                               (e ? std::string(" (") + std::strerror(e) + ")" : std::string()));
  }
  std::vector<std::shared_ptr<RdmaDevice>> out;
  std::string skipped;   // devices that were wanted but are unusable
  std::string filtered;  // devices left out by the name filter
  std::vector<std::string> present;
  for (int i = 0; i < n; ++i) present.push_back(api->get_device_name(list[i]));
  for (const std::string& name : SelectDevices(filter, present, &filtered, &skipped)) {
    const int i = static_cast<int>(std::find(present.begin(), present.end(), name) - present.begin());
    auto d = std::make_shared<RdmaDevice>();
    d->api = api;
    d->name = name;
    d->ctx = api->open_device(list[i]);
    if (!d->ctx) {
      skipped += " " + name + " (cannot open: " + std::strerror(errno) + ")";
      continue;
    }
    ibv_device_attr da{};
    if (api->query_device(d->ctx, &da) != 0) {
      skipped += " " + name + " (query_device failed)";
      continue;
    }
    bool found = false;
    for (uint8_t p = 1; p <= da.phys_port_cnt && !found; ++p) {
      ibv_port_attr pa{};
      if (api->query_port(d->ctx, p, &pa) != 0 || pa.state != IBV_PORT_ACTIVE) continue;
      d->port = p;
      d->roce = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
      d->lid = pa.lid;
      d->active_mtu = pa.active_mtu;
      if (pa.max_msg_sz > 0) d->max_msg_bytes = std::min<uint64_t>(pa.max_msg_sz, 1u << 30);
      int gi = static_cast<int>(gid_index);
      if (gi < 0) gi = d->roce ? PickRoceGid(api, *d, pa.gid_tbl_len) : 0;
      if (gi < 0 || gi >= pa.gid_tbl_len || api->query_gid(d->ctx, p, gi, &d->gid) != 0 || ZeroGid(d->gid)) {
        if (gid_index >= 0) {
          skipped +=
              " " + name + " port " + std::to_string(p) + " (no usable GID at index " + std::to_string(gi) +
              ", set by " + gid_from + ": " +
              (gi >= pa.gid_tbl_len ? "beyond the port's GID table of " + std::to_string(pa.gid_tbl_len) + " entries"
                                    : std::string("that entry is empty or unreadable")) +
              ")";
        } else {
          skipped += " " + name + " port " + std::to_string(p) + " (no usable GID" +
                     (gi >= 0 ? " at index " + std::to_string(gi) : std::string(": no IPv4-mapped RoCE v2 GID")) +
                     "; set gid_index or MORI_IB_GID_INDEX)";
        }
        continue;
      }
      d->gid_index = gi;
      found = true;
    }
    if (!found) {
      if (skipped.find(name) == std::string::npos) skipped += " " + name + " (no active port)";
      continue;
    }
    d->pd = api->alloc_pd(d->ctx);
    if (!d->pd) {
      skipped += " " + name + " (alloc_pd failed)";
      continue;
    }
    d->max_qp_wr = da.max_qp_wr;
    d->max_cqe = da.max_cqe;
    d->max_rd_atomic = std::max(1, std::min(da.max_qp_rd_atom, da.max_qp_init_rd_atom));
    MORI_LOG(Info, "RDMA: using " << name << " port " << static_cast<int>(d->port) << " GID index " << d->gid_index
                                  << " " << GidText(d->gid) << " MTU " << (128 << static_cast<int>(d->active_mtu)));
    out.push_back(std::move(d));
  }
  api->free_device_list(list);
  if (out.empty()) throw Error(StatusCode::ERR_BAD_STATE, none + ":" + skipped + filtered);
  // A device that was asked for (or, unfiltered, exists) but cannot be used
  // is not silently dropped: fewer rails than expected is worth a warning.
  if (!skipped.empty()) MORI_LOG(Warning, "RDMA: " << out.size() << " device(s) usable; left out:" << skipped);
  if (!filtered.empty()) MORI_LOG(Debug, "RDMA: left out:" << filtered);
  // Rails in SelectDevices' order: the same on every engine of a host,
  // whatever order the kernel lists the devices in.
  return out;
}

}  // namespace rdma
}  // namespace mori_torch
