// libFuzzer entry point for the frame decoder and the message parser (see fuzz_harness.h).
// Built by scripts/fuzz-transport.sh; not part of the CMake build.
#include <cstddef>
#include <cstdint>

#include "tests/transport/fuzz_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  parapilot::transport::fuzz::run_one_input(data, size);
  return 0;
}
