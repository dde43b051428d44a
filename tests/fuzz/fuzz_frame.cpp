// libFuzzer target: the control-plane frame reader and the payload decoders
// behind it (Hello, Error). Input: the first byte picks how the stream is cut
// into reads; the rest is the byte stream. Checks: no crash or sanitizer
// report, and the reader never holds more payload than bytes it was fed.
#include <cstddef>
#include <cstdint>

#include "core/control_plane.h"
#include "core/frame.h"
#include "core/logging.h"

using namespace mori_torch;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t cut = 1 + data[0] % 97;  // bytes per read
  data++;
  size--;
  FrameReader rd;
  size_t fed = 0;
  while (fed < size) {
    size_t n = std::min(cut, size - fed), used = 0;
    FrameReader::Step s = rd.Feed(data + fed, n, &used);
    if (used > n) __builtin_trap();
    fed += used;
    if (s == FrameReader::Step::kError) break;
    if (s == FrameReader::Step::kFrame) {
      Frame f = rd.Take();
      if (f.payload.size() > kMaxFramePayload || f.payload.size() > fed) __builtin_trap();
      try {
        if (f.type == FrameType::Hello) {
          Hello h = DecodeHello(f);
          (void)EncodeHello(h.kind, h.backend, h.peer);
        } else if (f.type == FrameType::Error) {
          (void)DecodeErrorPayload(f, "fuzz");
        }
      } catch (const Error&) {
      }
      continue;
    }
    if (used == 0) break;
  }
  return 0;
}
