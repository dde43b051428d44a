// Shapes of the page-copy kernel (csrc/gpu/copy_kernels.cu) timed against one
// contiguous cudaMemcpyAsync of the same bytes, CUDA events, one GPU: group
// size, block size, loads in flight, list in mapped pinned host memory or in
// device memory, and a grid-stride form. 16,384 permuted pages of 4, 16 and
// 64 KiB. Figures: docs/BENCHMARK.md, "Two H200s, and one GPU of that host".
// CopySeg is the backend kernel's loop with its constants made template
// parameters (benchmarks/bench_copy_kernel.cu times the shipped kernel itself).
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/kvar benchmarks/copy_kernel_variants.cu && /tmp/kvar 100
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>
#define CK(x)                                         \
  do {                                                \
    cudaError_t e_ = (x);                             \
    if (e_ != cudaSuccess) {                          \
      printf("%s: %s\n", #x, cudaGetErrorString(e_)); \
      exit(1);                                        \
    }                                                 \
  } while (0)
struct Seg {
  uint64_t dst, src, bytes;
};

template <int G, int U>
__device__ __forceinline__ void CopySeg(const Seg& sg, uint32_t lane) {
  auto* d = reinterpret_cast<uint4*>(sg.dst);
  const auto* s = reinterpret_cast<const uint4*>(sg.src);
  const uint64_t n = sg.bytes / 16;
  constexpr uint64_t kStep = (uint64_t)G * U;
  uint64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = s[i + lane + u * G];
#pragma unroll
    for (int u = 0; u < U; ++u) d[i + lane + u * G] = v[u];
  }
  if (i < n) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + lane + u * G < n) v[u] = s[i + lane + u * G];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + lane + u * G < n) d[i + lane + u * G] = v[u];
  }
}

// T threads per block, groups of G, U loads in flight: entries loaded once per block into shared memory
template <int G, int T, int U>
__global__ void __launch_bounds__(T) K(const Seg* segs, uint32_t count) {
  constexpr int GPB = T / G;
  constexpr int W = 3;
  __shared__ uint64_t e[GPB * W];
  const uint64_t first = (uint64_t)blockIdx.x * GPB;
  if (first >= count) return;
  const uint64_t here = count - first < GPB ? count - first : GPB;
  if (threadIdx.x < here * W) e[threadIdx.x] = reinterpret_cast<const uint64_t*>(segs + first)[threadIdx.x];
  __syncthreads();
  const uint32_t g = threadIdx.x / G;
  if (g >= here) return;
  Seg s{e[g * W], e[g * W + 1], e[g * W + 2]};
  CopySeg<G, U>(s, threadIdx.x % G);
}

// persistent grid-stride over segments: each group takes segments gid, gid+ngroups, ... (list entry per group)
template <int G, int T, int U>
__global__ void __launch_bounds__(T) KStride(const Seg* segs, uint32_t count) {
  const uint32_t groups = gridDim.x * (T / G);
  for (uint32_t gi = blockIdx.x * (T / G) + threadIdx.x / G; gi < count; gi += groups) {
    Seg s = segs[gi];
    CopySeg<G, U>(s, threadIdx.x % G);
  }
}

// Mismatching 8-byte words between each segment's destination and source.
__global__ void CountMismatches(const Seg* segs, uint32_t count, unsigned long long* bad) {
  for (uint32_t i = blockIdx.x; i < count; i += gridDim.x) {
    const auto* d = reinterpret_cast<const uint64_t*>(segs[i].dst);
    const auto* s = reinterpret_cast<const uint64_t*>(segs[i].src);
    for (uint64_t k = threadIdx.x; k < segs[i].bytes / 8; k += blockDim.x)
      if (d[k] != s[k]) atomicAdd(bad, 1ull);
  }
}

// Word k of the source holds k: every page differs from every other.
__global__ void FillPattern(uint64_t* a, uint64_t words) {
  for (uint64_t k = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; k < words; k += (uint64_t)gridDim.x * blockDim.x)
    a[k] = k * 0x9E3779B97F4A7C15ull;
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    cudaEventCreate(&a);
    cudaEventCreate(&b);
  }
};

int main(int argc, char** argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 100;
  size_t buf = (size_t)1 << 30;
  char *A, *B;
  CK(cudaMalloc(&A, buf));
  CK(cudaMalloc(&B, buf));
  FillPattern<<<1024, 256>>>(reinterpret_cast<uint64_t*>(A), buf / 8);
  CK(cudaDeviceSynchronize());
  unsigned long long* bad;
  CK(cudaMallocManaged(&bad, sizeof(*bad)));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp pr;
  cudaGetDeviceProperties(&pr, 0);
  printf("device %s sms %d (every variant's bytes checked)\n", pr.name, sms);
  Timer t;
  for (uint64_t page : {4096ull, 16384ull, 65536ull}) {
    const uint32_t n = 16384;
    std::vector<uint32_t> perm(n);
    for (uint32_t i = 0; i < n; ++i) perm[i] = i;
    std::mt19937 rng(7);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<Seg> h(n);
    for (uint32_t i = 0; i < n; ++i)
      h[i] = {(uint64_t)B + (uint64_t)i * page, (uint64_t)A + (uint64_t)perm[i] * page, page};
    Seg* pinned;
    CK(cudaHostAlloc(&pinned, n * sizeof(Seg), cudaHostAllocMapped));
    memcpy(pinned, h.data(), n * sizeof(Seg));
    Seg* pdev;
    CK(cudaHostGetDevicePointer(&pdev, pinned, 0));
    Seg* dlist;
    CK(cudaMalloc(&dlist, n * sizeof(Seg)));
    CK(cudaMemcpy(dlist, h.data(), n * sizeof(Seg), cudaMemcpyHostToDevice));
    const uint64_t bytes = page * n;
    struct V {
      std::string name;
      std::function<void()> f;
    };
    std::vector<V> vs;
    auto add = [&](std::string nm, std::function<void()> f) { vs.push_back({nm, f}); };
    add("memcpy_contig", [&] { cudaMemcpyAsync(B, A, bytes, cudaMemcpyDeviceToDevice, st); });
#define KV(G, T, U)                                                                                               \
  add("blk G" #G " T" #T " U" #U " host", [&] { K<G, T, U><<<(n + T / G - 1) / (T / G), T, 0, st>>>(pdev, n); }); \
  add("blk G" #G " T" #T " U" #U " dev", [&] { K<G, T, U><<<(n + T / G - 1) / (T / G), T, 0, st>>>(dlist, n); });
    KV(64, 256, 8)
    KV(64, 512, 8) KV(128, 256, 8) KV(128, 512, 8) KV(32, 256, 8) KV(64, 256, 4) KV(64, 256, 16) KV(256, 256, 4)
        KV(128, 128, 8) KV(512, 512, 4) KV(1024, 1024, 2) KV(256, 1024, 8) add("h2d list + blk G64 T256 U8 dev", [&] {
          cudaMemcpyAsync(dlist, pinned, n * sizeof(Seg), cudaMemcpyHostToDevice, st);
          K<64, 256, 8><<<(n + 3) / 4, 256, 0, st>>>(dlist, n);
        });
    for (int waves : {1, 2, 4}) {
      int per = 0;
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, KStride<64, 256, 8>, 256, 0);
      int grid = sms * per * waves;
      add("stride G64 T256 U8 grid x" + std::to_string(waves) + " dev",
          [&, grid] { KStride<64, 256, 8><<<grid, 256, 0, st>>>(dlist, n); });
    }
    std::vector<std::vector<float>> ts(vs.size());
    for (int r = 0; r < iters; ++r) {
      for (size_t v = 0; v < vs.size(); ++v) {
        cudaEventRecord(t.a, st);
        vs[v].f();
        cudaEventRecord(t.b, st);
        CK(cudaEventSynchronize(t.b));
        float ms;
        cudaEventElapsedTime(&ms, t.a, t.b);
        if (r >= 5) ts[v].push_back(ms * 1000);
      }
    }
    CK(cudaGetLastError());
    // Each variant once more into a cleared destination, its bytes checked
    // (the contiguous memcpy is not a gather: not checked).
    for (size_t v = 1; v < vs.size(); ++v) {
      CK(cudaMemsetAsync(B, 0, bytes, st));
      vs[v].f();
      *bad = 0;
      CountMismatches<<<1024, 256, 0, st>>>(dlist, n, bad);
      CK(cudaStreamSynchronize(st));
      if (*bad != 0) {
        printf("%s: %llu words differ\n", vs[v].name.c_str(), *bad);
        return 1;
      }
    }
    float base = 0;
    for (size_t v = 0; v < vs.size(); ++v) {
      auto& x = ts[v];
      std::sort(x.begin(), x.end());
      float p50 = x[x.size() / 2];
      if (v == 0) base = p50;
      printf("page %6llu %-34s p50 %8.1f us  p10 %8.1f  GB/s %7.1f  memcpy/this %.3f\n", (unsigned long long)page,
             vs[v].name.c_str(), p50, x[x.size() / 10], bytes / p50 / 1e3, base / p50);
    }
    cudaFreeHost(pinned);
    cudaFree(dlist);
  }
  return 0;
}
