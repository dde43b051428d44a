// libFuzzer target: EngineDesc / MemoryDesc unpacking. The first byte picks
// the descriptor kind. Checks: malformed bytes raise Error (nothing else), and
// whatever unpacks packs back to the same descriptor.
#include <cstddef>
#include <cstdint>

#include "core/descriptors.h"

using namespace mori_torch;

template <typename D>
void RoundTrip(const uint8_t* data, size_t size) {
  D d;
  try {
    d = D::Unpack(data, size);
  } catch (const Error&) {
    return;
  }
  auto packed = d.Pack();
  D again = D::Unpack(packed.data(), packed.size());
  if (!(again == d)) __builtin_trap();
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] & 1) {
    RoundTrip<MemoryDesc>(data + 1, size - 1);
  } else {
    RoundTrip<EngineDesc>(data + 1, size - 1);
  }
  return 0;
}
