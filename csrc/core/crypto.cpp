#include "core/crypto.h"

#include <dlfcn.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/config_table.h"
#include "core/types.h"

namespace mori_torch {
namespace crypto {
namespace {

// OpenSSL 3 entry points (stable under the libcrypto.so.3 soname), declared
// here so that building needs no OpenSSL headers. EVP_MD is opaque.
struct Api {
  const void* (*evp_sha256)() = nullptr;
  unsigned char* (*hmac)(const void* md, const void* key, int key_len, const unsigned char* d, size_t n,
                         unsigned char* md_out, unsigned int* md_len) = nullptr;
  int (*rand_bytes)(unsigned char* buf, int num) = nullptr;
  int (*crypto_memcmp)(const void* a, const void* b, size_t len) = nullptr;
  std::string error;
};

const Api& Lib() {
  static const Api api = [] {
    Api a;
    // Overridable so a test can point at a library that does not exist.
    const std::string lib_name = config::EnvText("MORI_TORCH_LIBCRYPTO");
    const char* name = lib_name.c_str();
    void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      a.error = std::string("cannot load ") + name +
                " (install OpenSSL 3's libcrypto, e.g. Debian's libssl3): " + (e ? e : "unknown error");
      return a;
    }
    a.evp_sha256 = reinterpret_cast<decltype(a.evp_sha256)>(dlsym(lib, "EVP_sha256"));
    a.hmac = reinterpret_cast<decltype(a.hmac)>(dlsym(lib, "HMAC"));
    a.rand_bytes = reinterpret_cast<decltype(a.rand_bytes)>(dlsym(lib, "RAND_bytes"));
    a.crypto_memcmp = reinterpret_cast<decltype(a.crypto_memcmp)>(dlsym(lib, "CRYPTO_memcmp"));
    if (!a.evp_sha256 || !a.hmac || !a.rand_bytes || !a.crypto_memcmp) {
      a.error = std::string(name) + " lacks one of EVP_sha256, HMAC, RAND_bytes, CRYPTO_memcmp";
      a = Api{{}, {}, {}, {}, a.error};
    }
    return a;  // the library stays loaded for the life of the process
  }();
  return api;
}

}  // namespace

const std::string& LibcryptoError() { return Lib().error; }

Mac HmacSha256(const std::string& key, const uint8_t* data, size_t n) {
  const Api& a = Lib();
  if (!a.error.empty()) throw Error(StatusCode::ERR_BAD_STATE, "HMAC-SHA256: " + a.error);
  Mac out{};
  unsigned int len = 0;
  static const uint8_t kEmpty = 0;
  if (!a.hmac(a.evp_sha256(), key.data(), static_cast<int>(key.size()), n ? data : &kEmpty, n, out.data(), &len) ||
      len != out.size()) {
    throw Error(StatusCode::ERR_BAD_STATE, "HMAC-SHA256 failed in libcrypto");
  }
  return out;
}

void SecureRandom(void* out, size_t n) {
  const Api& a = Lib();
  if (a.error.empty()) {
    if (a.rand_bytes(static_cast<unsigned char*>(out), static_cast<int>(n)) == 1) return;
    throw Error(StatusCode::ERR_BAD_STATE, "RAND_bytes failed: libcrypto's CSPRNG is not seeded");
  }
  auto* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    ssize_t got = getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw Error(StatusCode::ERR_BAD_STATE, std::string("getrandom failed: ") + std::strerror(errno));
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
}

bool ConstantTimeEqual(const void* a, const void* b, size_t n) {
  const Api& api = Lib();
  if (api.error.empty()) return api.crypto_memcmp(a, b, n) == 0;
  const volatile uint8_t* x = static_cast<const uint8_t*>(a);
  const volatile uint8_t* y = static_cast<const uint8_t*>(b);
  uint8_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff |= x[i] ^ y[i];
  return diff == 0;
}

}  // namespace crypto
}  // namespace mori_torch
