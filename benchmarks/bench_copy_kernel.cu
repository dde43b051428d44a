// The XGMI backend's segment-copy kernel alone (gpu::LaunchSegmentCopy, the
// list already in device memory, and in mapped pinned host memory as the
// backend passes it), against cudaMemcpyAsync of the same bytes
// in one contiguous piece (what torch's copy_ does), both timed with CUDA
// events on one stream: is the kernel what keeps page batches below copy_,
// or the host work before it? Both buffers on one GPU (HBM read plus write).
// Pages of 4, 16 and 64 KiB, 16,384 per batch, source pages permuted.
//
//   nvcc -O3 -std=c++17 -DMORI_WITH_GPU=1 -Icsrc -arch=native benchmarks/bench_copy_kernel.cu \
//       csrc/gpu/copy_kernels.cu csrc/gpu/gpu_runtime.cpp csrc/base/error.cpp -o /tmp/bench_copy_kernel
//   /tmp/bench_copy_kernel [--json out.json] [--reps 25]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_runtime.h"

namespace {

#define CHECK(x)                                                    \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

// Median GPU time (us) of `fn` enqueued on `s`, after 3 untimed runs.
template <typename F>
double MedianUs(cudaStream_t s, int reps, F fn) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < reps + 3; ++r) {
    CHECK(cudaEventRecord(a, s));
    fn();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 3) t.push_back(ms);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2] * 1e3;
}

// Every 8 bytes of the source hold their own index, so that a page copied
// from the wrong place, or not at all, shows.
__global__ void FillIndices(uint64_t* p, uint64_t n) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = i;
}

}  // namespace

int main(int argc, char** argv) {
  const char* json = nullptr;
  int reps = 25;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc)
      json = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
  }
  const uint64_t buf = 1ull << 30;
  const uint32_t count = 16384;
  void *src = nullptr, *dst = nullptr;
  CHECK(cudaMalloc(&src, buf));
  CHECK(cudaMalloc(&dst, buf));
  FillIndices<<<1024, 256>>>(static_cast<uint64_t*>(src), buf / 8);
  CHECK(cudaGetLastError());
  mori_torch::gpu::CopySegment* dev_list = nullptr;
  mori_torch::gpu::CopySegment* host_list = nullptr;
  CHECK(cudaMalloc(&dev_list, count * sizeof(*dev_list)));
  CHECK(cudaMallocHost(&host_list, count * sizeof(*host_list)));
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::string out = "[";
  for (uint64_t seg : {4096ull, 16384ull, 65536ull}) {
    std::vector<uint32_t> perm(buf / seg);
    std::iota(perm.begin(), perm.end(), 0u);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
    for (uint32_t i = 0; i < count; ++i) {
      host_list[i] = {reinterpret_cast<uint64_t>(dst) + i * seg, reinterpret_cast<uint64_t>(src) + perm[i] * seg, seg};
    }
    CHECK(cudaMemcpy(dev_list, host_list, count * sizeof(*dev_list), cudaMemcpyHostToDevice));
    const uint64_t bytes = count * seg;
    const double copy_us =
        MedianUs(s, reps, [&] { CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s)); });
    // Every destination page holds its source page: first and last word.
    const uint64_t words = seg / 8;
    auto copied_right = [&] {
      std::vector<uint64_t> got(bytes / 8);
      CHECK(cudaMemcpy(got.data(), dst, bytes, cudaMemcpyDeviceToHost));
      bool ok = true;
      for (uint32_t i = 0; i < count && ok; ++i) {
        ok = got[i * words] == perm[i] * words && got[i * words + words - 1] == perm[i] * words + words - 1;
      }
      return ok;
    };
    CHECK(cudaMemset(dst, 0, bytes));
    const double kernel_us = MedianUs(s, reps, [&] { mori_torch::gpu::LaunchSegmentCopy(dev_list, count, s); });
    bool ok = copied_right();
    // The list as the backend passes it: pinned host memory, read by the
    // kernel across the bus (cudaMallocHost memory is mapped under UVA).
    CHECK(cudaMemset(dst, 0, bytes));
    const double host_list_us = MedianUs(s, reps, [&] { mori_torch::gpu::LaunchSegmentCopy(host_list, count, s); });
    ok = ok && copied_right();
    const double upload_us = MedianUs(s, reps, [&] {
      CHECK(cudaMemcpyAsync(dev_list, host_list, count * sizeof(*dev_list), cudaMemcpyHostToDevice, s));
    });
    const double gbps = bytes / kernel_us / 1e3, base_gbps = bytes / copy_us / 1e3;
    std::printf(
        "%5llu KiB x %u: kernel %7.1f us %7.1f GB/s | cudaMemcpyAsync %7.1f us %7.1f GB/s | ratio %.3f | "
        "list in pinned host memory %7.1f us, ratio %.3f | list upload (%u x 24 B) %5.1f us | bytes %s\n",
        static_cast<unsigned long long>(seg / 1024), count, kernel_us, gbps, copy_us, base_gbps, copy_us / kernel_us,
        host_list_us, copy_us / host_list_us, count, upload_us, ok ? "ok" : "WRONG");
    if (!ok) return 1;
    char rec[1024];
    std::snprintf(rec, sizeof rec,
                  "%s\n {\"case\": \"kernel_only\", \"gpu\": \"%s\", \"segment_bytes\": %llu, \"segments\": %u, "
                  "\"kernel_us\": %.2f, \"gbps\": %.1f, \"baseline\": \"cudaMemcpyAsync of the same bytes, contiguous, "
                  "same device, same run\", \"baseline_us\": %.2f, \"baseline_gbps\": %.1f, \"ratio\": %.3f, "
                  "\"host_list_kernel_us\": %.2f, \"host_list_ratio\": %.3f, \"list_upload_us\": %.2f, \"reps\": %d}",
                  out.size() > 1 ? "," : "", prop.name, static_cast<unsigned long long>(seg), count, kernel_us, gbps,
                  copy_us, base_gbps, copy_us / kernel_us, host_list_us, copy_us / host_list_us, upload_us, reps);
    out += rec;
  }
  out += "\n]\n";
  if (json) {
    FILE* f = std::fopen(json, "w");
    if (!f) return 1;
    std::fputs(out.c_str(), f);
    std::fclose(f);
  }
  return 0;
}
