// The few primitives peer authentication and memory tokens need, from
// OpenSSL's libcrypto (libcrypto.so.3), loaded at run time: the package imports
// and engines without a secret run on a machine without it. No crypto of our own.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mori_torch {
namespace crypto {

constexpr size_t kHmacBytes = 32;  // HMAC-SHA256
using Mac = std::array<uint8_t, kHmacBytes>;

// "" when libcrypto is usable, else why not (the library or a symbol is missing).
const std::string& LibcryptoError();

// HMAC-SHA256 of `data` under `key`. Throws Error when libcrypto is missing.
Mac HmacSha256(const std::string& key, const uint8_t* data, size_t n);

// Fills `out` from a CSPRNG: libcrypto's RAND_bytes, or the kernel's
// getrandom(2) when libcrypto is missing. Throws Error if neither answers.
void SecureRandom(void* out, size_t n);

// Compares in time independent of where the bytes differ (CRYPTO_memcmp, or
// an equivalent branch-free loop without libcrypto).
bool ConstantTimeEqual(const void* a, const void* b, size_t n);

}  // namespace crypto
}  // namespace mori_torch
