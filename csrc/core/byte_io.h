// Little-endian byte writer and a bounds-checked reader for descriptors and
// control frames. The reader never reads past its buffer: every overrun is an
// Error naming what was being read.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/types.h"

namespace mori_torch {

class ByteWriter {
 public:
  template <typename T>
  void Put(T v) {
    static_assert(std::is_integral<T>::value, "integers only");
    const size_t at = buf_.size();
    buf_.resize(at + sizeof(T));
    for (size_t i = 0; i < sizeof(T); ++i) buf_[at + i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
  }
  void PutBytes(const void* p, size_t n) {
    if (n == 0) return;
    const size_t at = buf_.size();
    buf_.resize(at + n);
    std::memcpy(&buf_[at], p, n);
  }
  void PutString(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    PutBytes(s.data(), s.size());
  }
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size, const char* what) : p_(data), end_(data + size), what_(what) {}

  template <typename T>
  T Get(const char* field) {
    static_assert(std::is_integral<T>::value, "integers only");
    Need(sizeof(T), field);
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p_[i]) << (8 * i);
    p_ += sizeof(T);
    return static_cast<T>(v);
  }
  void GetBytes(void* out, size_t n, const char* field) {
    Need(n, field);
    if (n == 0) return;  // memcpy with a null pointer is undefined even for 0 bytes
    std::memcpy(out, p_, n);
    p_ += n;
  }
  std::string GetString(const char* field, size_t max_len = 4096) {
    uint32_t n = Get<uint32_t>(field);
    if (n > max_len) {
      throw Error(StatusCode::ERR_INVALID_ARGS, std::string(what_) + ": field '" + field + "' length " +
                                                    std::to_string(n) + " exceeds limit " + std::to_string(max_len));
    }
    Need(n, field);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  size_t remaining() const { return static_cast<size_t>(end_ - p_); }
  void ExpectEnd() const {
    if (p_ != end_) {
      throw Error(StatusCode::ERR_INVALID_ARGS, std::string(what_) + ": " + std::to_string(remaining()) +
                                                    " unexpected trailing bytes (oversized input)");
    }
  }

 private:
  void Need(size_t n, const char* field) const {
    if (static_cast<size_t>(end_ - p_) < n) {
      throw Error(StatusCode::ERR_INVALID_ARGS, std::string(what_) + ": truncated while reading '" + field +
                                                    "' (need " + std::to_string(n) + " bytes, have " +
                                                    std::to_string(end_ - p_) + ")");
    }
  }
  const uint8_t* p_;
  const uint8_t* end_;
  const char* what_;
};

}  // namespace mori_torch
