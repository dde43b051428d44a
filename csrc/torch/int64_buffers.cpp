#include "torch/int64_buffers.h"

#include <memory>
#include <mutex>
#include <vector>

namespace mori_torch {
namespace bind {
namespace {

// Bounds: at most kMaxPooled buffers of up to kMaxEntries entries (1 MiB
// each) stay allocated; an engine-level batch of 8 pairs holds 24 at once.
constexpr size_t kMaxPooled = 32;
constexpr size_t kMaxEntries = size_t{1} << 17;

class Int64BufferPool {
 public:
  // A buffer of at least n entries (n <= kMaxEntries): the smallest free one
  // that fits, else a new one sized to the next power of two (at least 1024).
  int64_t* Take(size_t n, size_t* cap) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      // Among equal fits, the one given back last: its pages are the warmest.
      size_t best = free_.size();
      for (size_t i = free_.size(); i-- > 0;) {
        if (free_[i].cap >= n && (best == free_.size() || free_[i].cap < free_[best].cap)) best = i;
      }
      if (best < free_.size()) {
        Buf b = std::move(free_[best]);
        free_[best] = std::move(free_.back());
        free_.pop_back();
        *cap = b.cap;
        return b.p.release();
      }
    }
    size_t c = 1024;
    while (c < n) c *= 2;
    *cap = c;
    return new int64_t[c];
  }
  void Give(int64_t* p, size_t cap) {
    Buf b{std::unique_ptr<int64_t[]>(p), cap};
    std::lock_guard<std::mutex> lk(mu_);
    if (free_.size() < kMaxPooled) free_.push_back(std::move(b));
  }

 private:
  struct Buf {
    std::unique_ptr<int64_t[]> p;
    size_t cap;
  };
  std::mutex mu_;
  std::vector<Buf> free_;
};

// Never destroyed: tensors may be freed during static destruction.
Int64BufferPool& Pool() {
  static Int64BufferPool* const pool = new Int64BufferPool();
  return *pool;
}

}  // namespace

at::Tensor PooledInt64Tensor(int64_t n) {
  const auto opts = at::TensorOptions().dtype(at::kLong);
  if (n <= 0 || static_cast<size_t>(n) > kMaxEntries) return at::empty({n}, opts);
  size_t cap = 0;
  int64_t* p = Pool().Take(static_cast<size_t>(n), &cap);
  try {
    return at::from_blob(
        p, {n}, [cap](void* q) { Pool().Give(static_cast<int64_t*>(q), cap); }, opts);
  } catch (...) {
    Pool().Give(p, cap);
    throw;
  }
}

}  // namespace bind
}  // namespace mori_torch
