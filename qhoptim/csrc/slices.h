// Stepping a large array in slices on several threads, for the fused CPU
// kernels of the MLX and optax backends (qhoptim/mlx/csrc,
// qhoptim/optax/csrc), which include it. MLX runs each CPU operation on one
// thread, XLA each custom call; an optimizer step moves memory, and one core
// does not draw all the bandwidth a socket has.

#pragma once

#include <algorithm>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sched.h>
#endif

namespace qhoptim::slices {

// The most threads one step takes: a few cores draw all of a socket's memory
// bandwidth.
constexpr int64_t kMaxThreads = 8;

// Below this many values per thread, a thread costs more than it saves.
constexpr int64_t kPerThread = int64_t{1} << 16;

// The cores this process may run on (its affinity mask on Linux, where a
// container's limit shows), at least 1.
inline int64_t usable_cores() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// step(first, count) over [0, n): on this thread alone, or in slices on up to
// kMaxThreads, this one taking the first. Each of the n units holds
// `unit_values` values (1; an 8-bit state's blocks: 256). Slices are a
// multiple of 64 values (4 lines of float32s, 2 of bfloat16s), so that no two
// threads write one 64-byte line of one array (where the range is several
// arrays end to end, as in optax's call, they may at an array's edges, and
// an 8-bit state's scales, 16 blocks' to a line, at a slice's: slower, never
// wrong). Where a thread cannot be started (a process's thread
// limit), this one steps its slice too. step must not throw.
template <class Step>
void for_each_slice(int64_t n, const Step& step, int64_t unit_values = 1) {
  if (n <= 0) return;
  const int64_t threads =
      std::min({usable_cores(), kMaxThreads, std::max<int64_t>(1, n * unit_values / kPerThread)});
  if (threads == 1) return step(int64_t{0}, n);
  const int64_t align = std::max<int64_t>(1, 64 / unit_values);  // units in 64 values
  const int64_t slice = ((n + threads - 1) / threads + align - 1) / align * align;
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads));
  std::vector<int64_t> here{0};  // the slices this thread steps
  for (int64_t first = slice; first < n; first += slice) {
    try {
      workers.emplace_back([&step, first, n, slice] { step(first, std::min(slice, n - first)); });
    } catch (const std::system_error&) {
      here.push_back(first);
    }
  }
  for (int64_t first : here) step(first, std::min(slice, n - first));
  for (auto& worker : workers) worker.join();
}

}  // namespace qhoptim::slices
