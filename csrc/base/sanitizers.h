// MORI_SANITIZED: 1 in ASan/TSan builds (GCC's __SANITIZE_* macros, clang's
// __has_feature), else 0. Such builds skip what would hide a fault from the
// sanitizer or run before its runtime: pooled memory, load-time dispatch.
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MORI_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define MORI_SANITIZED 1
#endif
#endif
#ifndef MORI_SANITIZED
#define MORI_SANITIZED 0
#endif
