// Clang's thread-safety annotations as macros (the model is LevelDB's port/thread_annotations.h):
// checked by `clang -Wthread-safety` (the thread_safety_test target, CI), no-ops elsewhere. Put
// them on members and methods of classes that lock common::Mutex (common/mutex.h): std::mutex
// in libstdc++ carries no annotations, so the analysis cannot see through it. Prefixed GRPO_:
// Abseil's unprefixed GRPO_GUARDED_BY & co. arrive with gRPC's headers, and one name for two macros
// warned "redefined" in every services/ unit.
#pragma once

#if defined(__clang__)
#define GRPO_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define GRPO_THREAD_ANNOTATION(x)  // gcc: no analysis
#endif

// A type that is a lock (common::Mutex).
#define GRPO_CAPABILITY(x) GRPO_THREAD_ANNOTATION(capability(x))
// An RAII holder of a lock (common::MutexLock).
#define GRPO_SCOPED_CAPABILITY GRPO_THREAD_ANNOTATION(scoped_lockable)
// A member read or written only with the lock held.
#define GRPO_GUARDED_BY(x) GRPO_THREAD_ANNOTATION(guarded_by(x))
// A pointer member whose pointee is read or written only with the lock held.
#define GRPO_PT_GUARDED_BY(x) GRPO_THREAD_ANNOTATION(pt_guarded_by(x))
// Lock ordering: this lock is taken after (or before) the named ones.
#define GRPO_ACQUIRED_AFTER(...) GRPO_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define GRPO_ACQUIRED_BEFORE(...) GRPO_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
// The caller holds the lock (the ...Locked() methods).
#define GRPO_REQUIRES(...) GRPO_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
// The caller must not hold the lock (the method takes it).
#define GRPO_EXCLUDES(...) GRPO_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
// Takes, releases, or asserts the lock.
#define GRPO_ACQUIRE(...) GRPO_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define GRPO_RELEASE(...) GRPO_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define GRPO_ASSERT_CAPABILITY(x) GRPO_THREAD_ANNOTATION(assert_capability(x))
// Returns the lock that guards (an accessor to a lock).
#define GRPO_RETURN_CAPABILITY(x) GRPO_THREAD_ANNOTATION(lock_returned(x))
// Opts a function out of the analysis: say why where it is used.
#define GRPO_NO_THREAD_SAFETY_ANALYSIS GRPO_THREAD_ANNOTATION(no_thread_safety_analysis)
