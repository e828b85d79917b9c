// nccl_check: the live worker's NCCL layer (env/live/nccl_comm.h) on the GPUs of this machine,
// without libtorch: N processes (rank r on device r % GPUs), the unique id exchanged through
// files, then sum and max all-reduces of float32 and float16 host buffers checked element by
// element, and the time of a float32 all-reduce of --mib MiB (host -> device -> NCCL -> host,
// the path the worker uses), median of 10.
//
//   nccl_check [--ranks N] [--mib M]
//
// Prints one line per rank and exits 0 when every rank's results were exact (2: no GPU).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "env/live/nccl_comm.h"

namespace {

// The float16 bits of a small positive integer (exact for 1..2047).
std::uint16_t half_of(int v) {
  int e = 0;
  while ((2 << e) <= v) ++e;
  const int mantissa = (v - (1 << e)) << (10 - e);
  return static_cast<std::uint16_t>(((e + 15) << 10) | mantissa);
}

int run_rank(int rank, int world, int devices, const std::string& dir, int mib) {
  using parapilot::live::NcclComm;
  auto set = [&](const std::string& key, const std::vector<std::uint8_t>& bytes) {
    const std::string tmp = dir + "/" + key + ".tmp";
    std::ofstream(tmp, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    std::filesystem::rename(tmp, dir + "/" + key);
  };
  auto get = [&](const std::string& key) {
    const std::string path = dir + "/" + key;
    for (int i = 0; i < 6000 && !std::filesystem::exists(path); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::ifstream in(path, std::ios::binary);
    return std::vector<std::uint8_t>((std::istreambuf_iterator<char>(in)),
                                     std::istreambuf_iterator<char>());
  };
  try {
    NcclComm comm(rank, world, rank % devices, "nccl-id", set, get, 60);
    const std::size_t n = 1 << 20;
    long wrong = 0;
    for (const bool max : {false, true}) {
      // Element i of rank r holds (r + 1) * (1 + i % 7).
      const auto expect = [&](std::size_t i) {
        const int k = 1 + static_cast<int>(i % 7);
        return max ? world * k : world * (world + 1) / 2 * k;
      };
      std::vector<float> f(n);
      for (std::size_t i = 0; i < n; ++i) f[i] = static_cast<float>((rank + 1) * (1 + i % 7));
      comm.all_reduce(f.data(), n, false, max);
      for (std::size_t i = 0; i < n; ++i) wrong += f[i] != static_cast<float>(expect(i));
      std::vector<std::uint16_t> h(n);
      for (std::size_t i = 0; i < n; ++i)
        h[i] = half_of((rank + 1) * (1 + static_cast<int>(i % 7)));
      comm.all_reduce(h.data(), n, true, max);
      for (std::size_t i = 0; i < n; ++i) wrong += h[i] != half_of(expect(i));
    }
    std::vector<float> big(static_cast<std::size_t>(mib) << 18, 1.0f);
    std::vector<double> ms;
    for (int i = 0; i < 12; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      comm.all_reduce(big.data(), big.size(), false);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                       .count());
    }
    ms.erase(ms.begin(), ms.begin() + 2);  // warm-up
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    const bool exact_big = big.front() == static_cast<float>(world) &&
                           big.back() == static_cast<float>(world);
    std::printf("rank %d/%d on GPU %d: %ld wrong elements of %zu (sum, max; float32, float16); "
                "%d MiB float32 all-reduce median %.3f ms (%.1f GB/s of buffer)%s\n",
                rank, world, rank % devices, wrong, 4 * n, mib, median,
                static_cast<double>(big.size()) * 4 / median / 1e6,
                exact_big ? "" : "; WRONG big-buffer result");
    return wrong == 0 && exact_big ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("rank %d/%d: %s\n", rank, world, e.what());
    return 3;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 1, mib = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--ranks") == 0)
      ranks = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--mib") == 0)
      mib = std::atoi(argv[i + 1]);
  }
  if (ranks < 1 || ranks > 64 || mib < 1 || mib > 4096 || argc % 2 == 0) {
    std::fprintf(stderr, "usage: nccl_check [--ranks N (1..64)] [--mib M (1..4096)]\n");
    return 2;
  }
  // CUDA must not be initialised before fork (a child could not use it): the ranks ask.
  std::printf("nccl_check: %d rank(s)\n", ranks);
  std::fflush(stdout);
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("parapilot-nccl-check-" + std::to_string(::getpid())))
                              .string();
  std::filesystem::create_directories(dir);
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const auto devices = parapilot::live::cuda_device_count();
      if (!devices.ok()) {
        std::printf("rank %d: %s\n", r, devices.status().message().c_str());
        std::fflush(stdout);
        ::_exit(2);
      }
      const int code = run_rank(r, ranks, *devices, dir, mib);
      std::fflush(stdout);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (const pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::filesystem::remove_all(dir);
  std::printf("nccl_check: %s\n", failed ? "FAILED" : "all ranks exact");
  return failed ? 1 : 0;
}
