#include "backends/rdma/verbs_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "base/config_table.h"

namespace mori_torch {
namespace rdma {
namespace {

struct Loaded {
  VerbsApi api{};
  bool ok = false;
  std::string why;
};

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn* out, std::string* why, bool required = true) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!*out && required) {
    *why = std::string("libibverbs.so.1 lacks ") + name;
    return false;
  }
  return true;
}

Loaded Load() {
  Loaded l;
  // Overridable so a test can point at a library that does not exist.
  const std::string lib_name = config::EnvText("MORI_TORCH_IBVERBS_LIB");
  const char* name = lib_name.c_str();
  void* lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL);  // providers resolve ibv_* against it
  if (!lib) {
    const char* e = dlerror();
    l.why = std::string("cannot load ") + name + " (install rdma-core's libibverbs1): " + (e ? e : "unknown error");
    return l;
  }
  VerbsApi& a = l.api;
  std::string& w = l.why;
  l.ok = Resolve(lib, "ibv_get_device_list", &a.get_device_list, &w) &&
         Resolve(lib, "ibv_free_device_list", &a.free_device_list, &w) &&
         Resolve(lib, "ibv_get_device_name", &a.get_device_name, &w) &&
         Resolve(lib, "ibv_open_device", &a.open_device, &w) && Resolve(lib, "ibv_close_device", &a.close_device, &w) &&
         Resolve(lib, "ibv_query_device", &a.query_device, &w) && Resolve(lib, "ibv_query_port", &a.query_port, &w) &&
         Resolve(lib, "ibv_query_gid", &a.query_gid, &w) && Resolve(lib, "ibv_alloc_pd", &a.alloc_pd, &w) &&
         Resolve(lib, "ibv_dealloc_pd", &a.dealloc_pd, &w) && Resolve(lib, "ibv_reg_mr", &a.reg_mr, &w) &&
         Resolve(lib, "ibv_reg_dmabuf_mr", &a.reg_dmabuf_mr, &w, /*required=*/false) &&
         Resolve(lib, "ibv_dereg_mr", &a.dereg_mr, &w) &&
         Resolve(lib, "ibv_create_comp_channel", &a.create_comp_channel, &w) &&
         Resolve(lib, "ibv_destroy_comp_channel", &a.destroy_comp_channel, &w) &&
         Resolve(lib, "ibv_create_cq", &a.create_cq, &w) && Resolve(lib, "ibv_destroy_cq", &a.destroy_cq, &w) &&
         Resolve(lib, "ibv_create_qp", &a.create_qp, &w) && Resolve(lib, "ibv_destroy_qp", &a.destroy_qp, &w) &&
         Resolve(lib, "ibv_modify_qp", &a.modify_qp, &w) && Resolve(lib, "ibv_get_cq_event", &a.get_cq_event, &w) &&
         Resolve(lib, "ibv_ack_cq_events", &a.ack_cq_events, &w) &&
         Resolve(lib, "ibv_wc_status_str", &a.wc_status_str, &w);
  return l;  // the library stays loaded: providers and MRs outlive any backend
}

}  // namespace

const VerbsApi* LoadVerbs(std::string* why) {
  static const Loaded loaded = Load();
  if (!loaded.ok) {
    *why = loaded.why;
    return nullptr;
  }
  return &loaded.api;
}

}  // namespace rdma
}  // namespace mori_torch
