#pragma once

// GPIPE_SANITIZED is defined in a build under ASan or TSan, whose
// allocators take malloc's place (so mallopt governs nothing) and whose
// shadow memory grows resident memory by design.

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define GPIPE_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define GPIPE_SANITIZED 1
#endif
#endif
