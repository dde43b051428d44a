#include "torch/int64_buffers.h"

#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <new>
#include <string>
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
  // Room for every buffer kept: giving one back (in a deleter) never allocates.
  Int64BufferPool() { free_.reserve(kMaxPooled); }

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
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));  // keeps the order given back
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

// A lent buffer: the context of its tensor's DataPtr.
struct Lent {
  int64_t* p;
  size_t cap;
};

void GiveBack(void* ctx) {
  std::unique_ptr<Lent> lent(static_cast<Lent*>(ctx));
  Pool().Give(lent->p, lent->cap);
}

}  // namespace

at::Tensor PooledInt64Tensor(int64_t n) {
  const auto opts = at::TensorOptions().dtype(at::kLong);
  if (n <= 0 || static_cast<size_t>(n) > kMaxEntries) return at::empty({n}, opts);
  size_t cap = 0;
  int64_t* p = Pool().Take(static_cast<size_t>(n), &cap);
  auto* lent = new (std::nothrow) Lent{p, cap};
  if (lent == nullptr) {
    Pool().Give(p, cap);
    throw std::bad_alloc();
  }
  // From here the DataPtr owns the buffer: whatever throws below gives it
  // back exactly once, through GiveBack.
  c10::DataPtr data(p, lent, &GiveBack, at::Device(at::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<int64_t>(static_cast<size_t>(n) * sizeof(int64_t)),
                       std::move(data), /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), caffe2::TypeMeta::Make<int64_t>());
  t.unsafeGetTensorImpl()->set_sizes_contiguous({n});
  return t;
}

void CheckInt64Vector(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, name, ": expected an int64 tensor, got ",
                   c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 1, name, ": expected a 1-D tensor, got ", std::to_string(t.dim()), " dimensions");
}

HostInt64 OnHost(const at::Tensor& t) { return {t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous()}; }

HostInt64 ToHostInt64(const at::Tensor& t, const char* name) {
  CheckInt64Vector(t, name);
  return OnHost(t);
}

}  // namespace bind
}  // namespace mori_torch
