// Keys and the manifest codec of the remote tier.
#include "daemon/remote/remote_layout.h"

#include "gtest/gtest.h"

namespace ckpt::remote {
namespace {

TEST(RemoteLayout, KeysParseBack) {
  const std::string m = ManifestKey("job-1", 7, 12345);
  EXPECT_EQ(m, "jobs/job-1/rank-00000007/m/S0000000000012345");
  uint64_t step = 0;
  ASSERT_TRUE(ParseManifestKey(m, "job-1", 7, &step));
  EXPECT_EQ(step, 12345u);
  EXPECT_FALSE(ParseManifestKey(m, "job-1", 8, &step));
  EXPECT_FALSE(ParseManifestKey(m + "x", "job-1", 7, &step));
  const std::string file = "L00000003-S0000000000000010-G0000000000000002.ckv";
  const std::string v = VersionObjectKey("job-1", 7, file);
  std::string parsed;
  ASSERT_TRUE(ParseVersionObjectKey(v, "job-1", 7, &parsed));
  EXPECT_EQ(parsed, file);
  EXPECT_FALSE(ParseVersionObjectKey(RankPrefix("job-1", 7) + "v/garbage", "job-1", 7, &parsed));
  std::string job;
  uint32_t rank = 0;
  ASSERT_TRUE(ParseRankOfKey(v, &job, &rank));
  EXPECT_EQ(job, "job-1");
  EXPECT_EQ(rank, 7u);
  EXPECT_FALSE(ParseRankOfKey("jobs/x", &job, &rank));
}

TEST(RemoteLayout, ManifestRoundTripsAndDamageIsDetected) {
  store::RemoteManifest m;
  m.set_job_id("j");
  m.set_rank(1);
  m.set_step(42);
  m.set_owner_uid(1000);
  m.mutable_event()->set_aux("aux bytes");
  store::RemoteVersion* v = m.add_versions();
  v->set_layer(2);
  v->set_step(40);
  v->mutable_record()->set_file("L00000002-S0000000000000028-G0000000000000001.ckv");
  const std::string bytes = EncodeManifest(m);
  auto back = DecodeManifest(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), m.SerializeAsString());
  // Every single flipped byte, and every truncation, is refused.
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    EXPECT_TRUE(absl::IsDataLoss(DecodeManifest(bad).status())) << "byte " << i;
  }
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_TRUE(absl::IsDataLoss(DecodeManifest(bytes.substr(0, n)).status())) << "length " << n;
  }
}

}  // namespace
}  // namespace ckpt::remote
