#include "core/thread_name.h"

#include <pthread.h>

#include <cstring>

namespace mori_torch {
namespace {

constexpr size_t kMaxName = 16;  // 15 bytes and the terminator (TASK_COMM_LEN)

struct CachedName {
  bool known = false;
  char name[kMaxName] = "";
};
thread_local CachedName t_name;

}  // namespace

void SetThreadName(const char* name) {
  std::strncpy(t_name.name, name, kMaxName - 1);
  t_name.name[kMaxName - 1] = '\0';
  t_name.known = true;
  pthread_setname_np(pthread_self(), t_name.name);
}

const char* ThisThreadName() {
  if (!t_name.known) {
    if (pthread_getname_np(pthread_self(), t_name.name, kMaxName) != 0) t_name.name[0] = '\0';
    t_name.known = true;
  }
  return t_name.name;
}

}  // namespace mori_torch
