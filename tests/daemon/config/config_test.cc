// Tests of daemon/config: parsing, dumping and validation of DaemonConfig.
#include "daemon/config/config.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::testing::TempDir;
using ::ckpt::testing::WriteFile;

bool Contains(absl::string_view haystack, absl::string_view needle) {
  return haystack.find(needle) != absl::string_view::npos;
}

TEST(ConfigTest, DefaultsDumpAndParseBack) {
  const DaemonConfig defaults;
  const std::string text = DumpConfig(defaults);
  DaemonConfig parsed;
  CKPT_ASSERT_OK(ParseConfigText(text, &parsed));
  EXPECT_EQ(DumpConfig(parsed), text);
  CKPT_EXPECT_OK(defaults.Validate());
}

TEST(ConfigTest, EveryOptionRoundTrips) {
  DaemonConfig c;
  c.socket = "/tmp/x/ckptd.sock";
  c.handover_socket = "/tmp/x/fds.sock";
  c.data_dir = "/data/ckpt";
  c.staging.budget_bytes = uint64_t{5} << 33;  // above 32 bits
  c.staging.chunk_bytes = 8192;
  c.staging.lock_memory = false;
  c.engine.writer_threads = 7;
  c.engine.snapshot_threads = 3;
  c.engine.io_backend = IoBackendKind::kPwrite;
  c.engine.io_queue_depth = 64;
  c.direct_io = false;
  c.engine.admission_timeout = absl::Milliseconds(11);
  c.engine.drain_timeout = absl::Milliseconds(12);
  c.shutdown_grace = absl::Milliseconds(13);
  c.rpc.max_message_bytes = 1 << 22;
  c.engine.max_aux_bytes = 14;
  c.handover.token_ttl = absl::Seconds(15);
  const std::string text = DumpConfig(c);
  EXPECT_NE(text, DumpConfig(DaemonConfig()));
  DaemonConfig parsed;
  CKPT_ASSERT_OK(ParseConfigText(text, &parsed));
  EXPECT_EQ(DumpConfig(parsed), text);
  EXPECT_EQ(parsed.staging.budget_bytes, uint64_t{5} << 33);
  EXPECT_EQ(parsed.engine.writer_threads, 7u);
  EXPECT_FALSE(parsed.direct_io);
  EXPECT_EQ(parsed.engine.io_backend, IoBackendKind::kPwrite);
  EXPECT_EQ(parsed.HandoverSocketPath(), "/tmp/x/fds.sock");
}

TEST(ConfigTest, DumpDocumentsEveryOption) {
  const std::string text = DumpConfig(DaemonConfig());
  for (const char* key :
       {"socket", "handover_socket", "data_dir", "staging_pool_bytes", "staging_chunk_bytes",
        "lock_staging_memory", "writer_threads", "snapshot_threads", "io_backend", "io_queue_depth",
        "direct_io", "admission_timeout_ms", "drain_timeout_ms", "shutdown_grace_ms",
        "max_message_bytes", "max_aux_bytes", "handover_token_ttl_s", "gpu_wait_timeout_ms"}) {
    EXPECT_TRUE(Contains(text, std::string("\n") + key + " = ")) << key;
    EXPECT_TRUE(Contains(ConfigHelp(), std::string("--") + key + "=")) << key;
  }
}

// The table is built once: setting options and dumping it does not grow it
// (the peer options, appended to the table, once were added at every call).
TEST(ConfigTest, EveryOptionIsListedOnceHoweverOftenTheTableIsRead) {
  DaemonConfig c;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(SetConfigOption("peer_rate_bytes", "1000", &c).ok());
    ASSERT_TRUE(c.Validate().ok());
  }
  for (const char* key : {"peer_listen", "peer_address", "socket"}) {
    const std::string text = DumpConfig(c);
    const std::string line = std::string("\n") + key + " = ";
    size_t n = 0;
    for (size_t at = text.find(line); at != std::string::npos; at = text.find(line, at + 1)) ++n;
    EXPECT_EQ(n, 1u) << key;
  }
}

// The wait for a GPU step's event and copies: 120 s by default, in
// milliseconds, never 0 (every step would be given up) and at most an hour.
TEST(ConfigTest, GpuWaitTimeoutIsReadInMillisecondsAndBounded) {
  DaemonConfig c;
  EXPECT_EQ(c.engine.gpu_wait_timeout, absl::Seconds(120));
  CKPT_ASSERT_OK(SetConfigOption("gpu_wait_timeout_ms", "250", &c));
  EXPECT_EQ(c.engine.gpu_wait_timeout, absl::Milliseconds(250));
  CKPT_EXPECT_OK(c.Validate());
  CKPT_ASSERT_OK(SetConfigOption("gpu_wait_timeout_ms", "0", &c));
  CKPT_EXPECT_CODE(c.Validate(), kInvalidArgument);
  CKPT_ASSERT_OK(SetConfigOption("gpu_wait_timeout_ms", "3600001", &c));
  CKPT_EXPECT_CODE(c.Validate(), kInvalidArgument);
}

TEST(ConfigTest, CommentsWhitespaceAndBlankLines) {
  DaemonConfig c;
  CKPT_ASSERT_OK(
      ParseConfigText("# a comment\n"
                      "\n"
                      "   writer_threads   =   9   # trailing comment\n"
                      "\tdirect_io=no\r\n"
                      "data_dir = /srv/ckpt\n",
                      &c));
  EXPECT_EQ(c.engine.writer_threads, 9u);
  EXPECT_FALSE(c.direct_io);
  EXPECT_EQ(c.data_dir, "/srv/ckpt");
}

TEST(ConfigTest, UnknownKeyNamesTheLine) {
  DaemonConfig c;
  absl::Status s = ParseConfigText("writer_threads = 2\n# x\nno_such_option = 1\n", &c);
  CKPT_ASSERT_CODE(s, kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "line 3")) << s;
  EXPECT_TRUE(Contains(s.message(), "no_such_option")) << s;
}

TEST(ConfigTest, BadNumbers) {
  for (const char* line :
       {"writer_threads = abc", "writer_threads = -1", "writer_threads = 4294967296",
        "writer_threads = 1.5", "writer_threads =", "staging_pool_bytes = 18446744073709551616",
        "io_queue_depth = 0x10"}) {
    DaemonConfig c;
    absl::Status s = ParseConfigText(std::string("\n") + line + "\n", &c);
    CKPT_EXPECT_CODE(s, kInvalidArgument) << line;
    EXPECT_TRUE(Contains(s.message(), "line 2")) << s;
  }
  DaemonConfig c;
  CKPT_ASSERT_OK(ParseConfigText("writer_threads = 4294967295", &c));
  EXPECT_EQ(c.engine.writer_threads, 4294967295u);
  // A number too large for its option names the option's bounds.
  absl::Status s = SetConfigOption("max_message_bytes", "3000000000", &c);
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "max_message_bytes must be 4096..2147483647")) << s;
}

TEST(ConfigTest, BadBoolAndMissingEquals) {
  DaemonConfig c;
  CKPT_EXPECT_CODE(ParseConfigText("direct_io = maybe", &c), kInvalidArgument);
  absl::Status s = ParseConfigText("socket = /a\njust words\n", &c);
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "line 2")) << s;
  for (const char* v : {"true", "1", "yes"}) {
    c.direct_io = false;
    CKPT_ASSERT_OK(SetConfigOption("direct_io", v, &c));
    EXPECT_TRUE(c.direct_io) << v;
  }
}

TEST(ConfigTest, SetConfigOptionUnknownKey) {
  DaemonConfig c;
  CKPT_EXPECT_CODE(SetConfigOption("nope", "1", &c), kInvalidArgument);
  CKPT_EXPECT_CODE(SetConfigOption("", "1", &c), kInvalidArgument);
}

TEST(ConfigTest, ValidateRejectsBadValues) {
  DaemonConfig c;
  c.staging.chunk_bytes = 4097;
  CKPT_EXPECT_CODE(c.Validate(), kInvalidArgument);
  c.staging.chunk_bytes = 0;
  CKPT_EXPECT_CODE(c.Validate(), kInvalidArgument);
  c.staging.chunk_bytes = 6144;
  CKPT_EXPECT_CODE(c.Validate(), kInvalidArgument);
  c = DaemonConfig();
  CKPT_EXPECT_CODE(SetConfigOption("io_backend", "foo", &c), kInvalidArgument);
  CKPT_EXPECT_CODE(SetConfigOption("io_backend", "", &c), kInvalidArgument);
  for (const char* ok : {"auto", "io_uring", "pwrite"}) {
    CKPT_ASSERT_OK(SetConfigOption("io_backend", ok, &c)) << ok;
    CKPT_EXPECT_OK(c.Validate()) << ok;
  }
  c = DaemonConfig();
  c.staging.budget_bytes = c.staging.chunk_bytes - 1;
  CKPT_EXPECT_CODE(c.Validate(), kInvalidArgument);
  c = DaemonConfig();
  c.engine.writer_threads = 0;
  CKPT_EXPECT_CODE(c.Validate(), kInvalidArgument);
  c = DaemonConfig();
  c.engine.io_queue_depth = 0;
  CKPT_EXPECT_CODE(c.Validate(), kInvalidArgument);
  c = DaemonConfig();
  c.data_dir = "";
  CKPT_EXPECT_CODE(c.Validate(), kInvalidArgument);
  c = DaemonConfig();
  c.engine.writer_threads = 65;  // every bound comes from the option table
  absl::Status s = c.Validate();
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "writer_threads must be 1..64")) << s;
}

// The subsystems' option structs are the one place each default is declared:
// the config file's defaults are theirs.
TEST(ConfigTest, DefaultsAreTheSubsystemsDefaults) {
  const DaemonConfig c;
  const EngineOptions engine;
  EXPECT_EQ(c.engine.writer_threads, engine.writer_threads);
  EXPECT_EQ(c.engine.gc_interval, engine.gc_interval);
  EXPECT_EQ(c.engine.min_free_disk_bytes, engine.min_free_disk_bytes);
  EXPECT_EQ(c.staging.budget_bytes, StagingPoolOptions().budget_bytes);
  EXPECT_EQ(c.handover.token_ttl, HandoverOptions().token_ttl);
  EXPECT_EQ(c.rpc.max_calls_per_uid, RpcServerOptions().max_calls_per_uid);
  const std::string text = DumpConfig(c);
  EXPECT_TRUE(Contains(text, absl::StrCat("\nwriter_threads = ", engine.writer_threads, "\n")));
  EXPECT_TRUE(Contains(
      text, absl::StrCat("\ngc_interval_s = ", absl::ToInt64Seconds(engine.gc_interval), "\n")));
}

// Regression: the metrics endpoint, which names every user's jobs, listened
// on every interface by default.
TEST(ConfigTest, MetricsListenOnLoopbackByDefault) {
  EXPECT_EQ(DaemonConfig().metrics_address, "127.0.0.1:9464");
}

TEST(ConfigTest, EffectiveConfigIsTitledAsSuch) {
  DaemonConfig c;
  c.engine.writer_threads = 5;
  const std::string text = DumpConfig(c, ConfigTitle::kEffective);
  EXPECT_FALSE(Contains(text, "shown with its default")) << text;
  EXPECT_TRUE(Contains(text, "\nwriter_threads = 5\n")) << text;
}

TEST(ConfigTest, HandoverSocketDefaultsNextToTheSocket) {
  DaemonConfig c;
  c.socket = "/run/x.sock";
  EXPECT_EQ(c.HandoverSocketPath(), "/run/x.sock.fds");
  c.handover_socket = "/run/h.sock";
  EXPECT_EQ(c.HandoverSocketPath(), "/run/h.sock");
}

TEST(ConfigTest, LoadConfigFile) {
  TempDir tmp;
  DaemonConfig c;
  CKPT_EXPECT_CODE(LoadConfigFile(tmp.Join("missing.conf"), &c), kNotFound);
  WriteFile(tmp.Join("ckptd.conf"), "io_queue_depth = 33\nsocket = /s\n");
  CKPT_ASSERT_OK(LoadConfigFile(tmp.Join("ckptd.conf"), &c));
  EXPECT_EQ(c.engine.io_queue_depth, 33u);
  EXPECT_EQ(c.socket, "/s");
}

TEST(ConfigTest, StepDoneWithTheLargestAuxMustFitMaxRequestBytes) {
  DaemonConfig c;
  CKPT_ASSERT_OK(SetConfigOption("max_aux_bytes", "8388608", &c));
  absl::Status s = c.Validate();
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "max_request_bytes must be at least max_aux_bytes")) << s;
  CKPT_ASSERT_OK(SetConfigOption("max_request_bytes", "12582912", &c));
  CKPT_EXPECT_OK(c.Validate());
}

// The memory tier is on unless turned off: a crashed trainer on a healthy
// node restores from memory with the shipped configuration.
TEST(ConfigTest, MemoryTierIsHalfThePoolByDefault) {
  DaemonConfig c;
  c.staging.budget_bytes = (uint64_t{9} << 20) + 4096;
  c.staging.chunk_bytes = uint64_t{1} << 20;
  EXPECT_EQ(c.MemoryTierBytes(), uint64_t{4} << 20);  // whole chunks
  EXPECT_TRUE(Contains(DumpConfig(c), "\nmemory_tier_bytes = auto\n"));
  CKPT_ASSERT_OK(ParseConfigText("memory_tier_bytes = 0\n", &c));
  EXPECT_EQ(c.MemoryTierBytes(), 0u);
  CKPT_ASSERT_OK(ParseConfigText("memory_tier_bytes = 3145728\n", &c));
  EXPECT_EQ(c.MemoryTierBytes(), uint64_t{3} << 20);
  CKPT_EXPECT_OK(c.Validate());
  CKPT_ASSERT_OK(ParseConfigText("memory_tier_bytes = auto\n", &c));
  EXPECT_EQ(c.MemoryTierBytes(), uint64_t{4} << 20);
  EXPECT_EQ(ParseConfigText("memory_tier_bytes = half\n", &c).code(),
            absl::StatusCode::kInvalidArgument);
  CKPT_ASSERT_OK(ParseConfigText("memory_tier_bytes = 10485760\n", &c));
  CKPT_EXPECT_CODE(c.Validate(), kInvalidArgument);  // more than the pool
}

}  // namespace
}  // namespace ckpt
