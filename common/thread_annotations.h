// Clang's thread-safety annotations as macros (the model is LevelDB's port/thread_annotations.h):
// checked by `clang -Wthread-safety` (the thread_safety_test target, CI), no-ops elsewhere. Put
// them on members and methods of classes that lock common::Mutex (common/mutex.h): std::mutex
// in libstdc++ carries no annotations, so the analysis cannot see through it.
#pragma once

#if defined(__clang__)
#define GRPO_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define GRPO_THREAD_ANNOTATION(x)  // gcc: no analysis
#endif

// A type that is a lock (common::Mutex).
#define CAPABILITY(x) GRPO_THREAD_ANNOTATION(capability(x))
// An RAII holder of a lock (common::MutexLock).
#define SCOPED_CAPABILITY GRPO_THREAD_ANNOTATION(scoped_lockable)
// A member read or written only with the lock held.
#define GUARDED_BY(x) GRPO_THREAD_ANNOTATION(guarded_by(x))
// A pointer member whose pointee is read or written only with the lock held.
#define PT_GUARDED_BY(x) GRPO_THREAD_ANNOTATION(pt_guarded_by(x))
// Lock ordering: this lock is taken after (or before) the named ones.
#define ACQUIRED_AFTER(...) GRPO_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define ACQUIRED_BEFORE(...) GRPO_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
// The caller holds the lock (the ...Locked() methods).
#define REQUIRES(...) GRPO_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
// The caller must not hold the lock (the method takes it).
#define EXCLUDES(...) GRPO_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
// Takes, releases, or asserts the lock.
#define ACQUIRE(...) GRPO_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) GRPO_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) GRPO_THREAD_ANNOTATION(assert_capability(x))
// Returns the lock that guards (an accessor to a lock).
#define RETURN_CAPABILITY(x) GRPO_THREAD_ANNOTATION(lock_returned(x))
// Opts a function out of the analysis: say why where it is used.
#define NO_THREAD_SAFETY_ANALYSIS GRPO_THREAD_ANNOTATION(no_thread_safety_analysis)
