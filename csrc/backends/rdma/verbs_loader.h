// libibverbs, loaded at run time with dlopen: the package imports and the
// core links on machines without rdma-core. Only the exported entry points
// are looked up here; the data-path calls (ibv_post_send, ibv_poll_cq, ...)
// are inline in verbs.h and go through the provider's function table.
#pragma once

#include <infiniband/verbs.h>

#include <string>

namespace mori_torch {
namespace rdma {

struct VerbsApi {
  decltype(&::ibv_get_device_list) get_device_list;
  decltype(&::ibv_free_device_list) free_device_list;
  decltype(&::ibv_get_device_name) get_device_name;
  decltype(&::ibv_open_device) open_device;
  decltype(&::ibv_close_device) close_device;
  decltype(&::ibv_query_device) query_device;
  // The exported symbol takes the compat struct, a prefix of ibv_port_attr.
  int (*query_port)(ibv_context*, uint8_t, ibv_port_attr*);
  decltype(&::ibv_query_gid) query_gid;
  decltype(&::ibv_alloc_pd) alloc_pd;
  decltype(&::ibv_dealloc_pd) dealloc_pd;
  struct ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int);
  decltype(&::ibv_reg_dmabuf_mr) reg_dmabuf_mr;  // nullptr in rdma-core < 34
  decltype(&::ibv_dereg_mr) dereg_mr;
  decltype(&::ibv_create_comp_channel) create_comp_channel;
  decltype(&::ibv_destroy_comp_channel) destroy_comp_channel;
  decltype(&::ibv_create_cq) create_cq;
  decltype(&::ibv_destroy_cq) destroy_cq;
  decltype(&::ibv_create_qp) create_qp;
  decltype(&::ibv_destroy_qp) destroy_qp;
  decltype(&::ibv_modify_qp) modify_qp;
  decltype(&::ibv_get_cq_event) get_cq_event;
  decltype(&::ibv_ack_cq_events) ack_cq_events;
  decltype(&::ibv_wc_status_str) wc_status_str;
};

// The loaded table (loaded once, kept for the process), or nullptr with
// *why naming the library or symbol that is missing.
const VerbsApi* LoadVerbs(std::string* why);

}  // namespace rdma
}  // namespace mori_torch
