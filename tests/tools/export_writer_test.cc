// WriteSafetensors and WriteFileBeneath: what `ckptctl export` writes into a
// directory it may not control, and the names it gives tensors.
#include "tools/export_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::testing::TempDir;

struct Tensor {
  std::string layer_name;
  uint32_t layer;
  std::string name;
  std::string bytes;
};

// The stream ckptd sends for `tensors`: a header, then the bytes.
std::vector<v1::ExportChunk> Stream(const std::vector<Tensor>& tensors) {
  std::vector<v1::ExportChunk> chunks(1);
  v1::ExportHeader* h = chunks[0].mutable_header();
  h->mutable_plan()->set_job_id("job");
  h->mutable_plan()->set_target_step(7);
  for (const Tensor& t : tensors) {
    v1::ExportTensor* et = h->add_tensors();
    et->set_layer(t.layer);
    et->set_layer_name(t.layer_name);
    et->set_name(t.name);
    et->set_dtype(v1::DTYPE_U8);
    et->add_shape(t.bytes.size());
    et->set_nbytes(t.bytes.size());
    h->set_total_bytes(h->total_bytes() + t.bytes.size());
    chunks.emplace_back().set_data(t.bytes);
  }
  return chunks;
}

ChunkSource From(std::vector<v1::ExportChunk> chunks) {
  auto next = std::make_shared<size_t>(0);
  auto all = std::make_shared<std::vector<v1::ExportChunk>>(std::move(chunks));
  return [next, all](v1::ExportChunk* c) {
    if (*next >= all->size()) return false;
    *c = (*all)[(*next)++];
    return true;
  };
}

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class ExportWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::mkdir(tmp_.Join("out").c_str(), 0700), 0);
    dir_ = ::open(tmp_.Join("out").c_str(), O_DIRECTORY | O_CLOEXEC);
    ASSERT_GE(dir_, 0);
  }
  void TearDown() override { ::close(dir_); }
  TempDir tmp_;
  int dir_ = -1;
};

// Regression: a tensor name repeated across layers became "layer/name",
// which could collide with a literal tensor named "layer/name", and a tensor
// named "__metadata__" was replaced by the metadata; the file silently lost
// or mislabelled tensors.
TEST_F(ExportWriterTest, NamesThatWouldCollideAreRefused) {
  absl::StatusOr<nlohmann::json> e =
      WriteSafetensors(From(Stream({{"a", 0, "x", "1"}, {"b", 1, "x", "2"}, {"c", 2, "a/x", "3"}})),
                       dir_, "r.safetensors", nullptr);
  CKPT_EXPECT_CODE(e, kInvalidArgument);
  e = WriteSafetensors(From(Stream({{"a", 0, "__metadata__", "1"}})), dir_, "r.safetensors",
                       nullptr);
  CKPT_EXPECT_CODE(e, kInvalidArgument);
  // Nothing is left behind, not even the temporary file.
  EXPECT_NE(::faccessat(dir_, "r.safetensors", F_OK, 0), 0);
  EXPECT_NE(::faccessat(dir_, "r.safetensors.tmp", F_OK, 0), 0);
  // Names that stay unique are fine, a repeated one qualified by its layer.
  CKPT_ASSERT_OK_AND_ASSIGN(nlohmann::json entry,
                            WriteSafetensors(From(Stream({{"a", 0, "x", "1"}, {"b", 1, "x", "2"}})),
                                             dir_, "r.safetensors", nullptr));
  EXPECT_EQ(entry["bytes"], 2);
  const std::string file = Read(tmp_.Join("out/r.safetensors"));
  EXPECT_NE(file.find("\"a/x\""), std::string::npos);
  EXPECT_NE(file.find("\"b/x\""), std::string::npos);
}

// Regression: export opened "<dir>/<file>.tmp" and manifest.json by path, so
// a symbolic link planted in a directory another user controls made an
// export run as root overwrite the link's target.
TEST_F(ExportWriterTest, PlantedSymbolicLinksAreReplacedNotFollowed) {
  const std::string victim = tmp_.Join("victim");
  { std::ofstream(victim) << "precious"; }
  for (const char* link :
       {"r.safetensors.tmp", "r.safetensors", "manifest.json", "manifest.json.tmp"}) {
    ASSERT_EQ(::symlinkat(victim.c_str(), dir_, link), 0) << link;
  }
  CKPT_ASSERT_OK(
      WriteSafetensors(From(Stream({{"a", 0, "x", "abc"}})), dir_, "r.safetensors", nullptr)
          .status());
  CKPT_ASSERT_OK(WriteFileBeneath(dir_, "manifest.json", "{}\n"));
  EXPECT_EQ(Read(victim), "precious");
  for (const char* name : {"r.safetensors", "manifest.json"}) {
    struct stat st;
    ASSERT_EQ(::fstatat(dir_, name, &st, AT_SYMLINK_NOFOLLOW), 0) << name;
    EXPECT_TRUE(S_ISREG(st.st_mode)) << name << " is still a link";
    EXPECT_EQ(st.st_mode & 0777, 0600u) << name;
  }
  EXPECT_EQ(Read(tmp_.Join("out/manifest.json")), "{}\n");
}

}  // namespace
}  // namespace ckpt
