// Helpers shared by the libFuzzer targets in tests/fuzz.
//
// Each target defines ckpt::Seeds() and ckpt::FuzzOne(data, size) and ends
// with CKPT_FUZZ_ENTRY_POINTS(), which defines libFuzzer's entry points:
// LLVMFuzzerInitialize calls InitFuzzTarget() with the seed inputs. When the environment variable
// CKPT_FUZZ_WRITE_SEEDS names a directory, InitFuzzTarget writes the seeds
// there (seed-000, seed-001, ...) and exits 0 instead of fuzzing; run_fuzz.sh
// and the ctest entries use that to build the seed corpus from code, so the
// seeds always match the current format.
#pragma once

#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace ckpt::fuzz {

// Aborts (a libFuzzer crash, with the input saved) when `cond` is false.
#define CKPT_FUZZ_CHECK(cond, msg)                                                                \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      std::fprintf(stderr, "%s:%d: fuzz invariant violated: %s: %s\n", __FILE__, __LINE__, #cond, \
                   std::string(msg).c_str());                                                     \
      std::abort();                                                                               \
    }                                                                                             \
  } while (0)

inline void InitFuzzTarget(const std::vector<std::string>& seeds) {
  // Protobuf logs every string field with invalid UTF-8 it parses: noise here.
  google::protobuf::SetLogHandler(nullptr);
  const char* dir = std::getenv("CKPT_FUZZ_WRITE_SEEDS");
  if (dir == nullptr || *dir == '\0') return;
  for (size_t i = 0; i < seeds.size(); ++i) {
    char name[32];
    std::snprintf(name, sizeof(name), "/seed-%03zu", i);
    const std::string path = std::string(dir) + name;
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr || std::fwrite(seeds[i].data(), 1, seeds[i].size(), f) != seeds[i].size() ||
        std::fclose(f) != 0) {
      std::fprintf(stderr, "cannot write seed %s\n", path.c_str());
      std::exit(1);
    }
  }
  std::fprintf(stderr, "wrote %zu seeds to %s\n", seeds.size(), dir);
  std::exit(0);
}

}  // namespace ckpt::fuzz

// libFuzzer's entry points over ckpt::Seeds() and ckpt::FuzzOne().
#define CKPT_FUZZ_ENTRY_POINTS()                                            \
  extern "C" int LLVMFuzzerInitialize(int*, char***) {                      \
    ckpt::fuzz::InitFuzzTarget(ckpt::Seeds());                              \
    return 0;                                                               \
  }                                                                         \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { \
    ckpt::FuzzOne(data, size);                                              \
    return 0;                                                               \
  }
