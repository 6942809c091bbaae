// Keys, the manifest and owner codecs and the cluster key of the remote tier.
#include "daemon/remote/remote_layout.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/remote/remote_auth.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt::remote {
namespace {

RemoteKey TestKey(char fill = 'k') { return *RemoteKey::FromSecret(std::string(32, fill)); }

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
  const RemoteKey key = TestKey();
  const std::string bytes = EncodeManifest(m, key);
  auto back = DecodeManifest(bytes, key);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), m.SerializeAsString());
  // Every single flipped byte, and every truncation, is refused.
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    EXPECT_TRUE(absl::IsDataLoss(DecodeManifest(bad, key).status())) << "byte " << i;
  }
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_TRUE(absl::IsDataLoss(DecodeManifest(bytes.substr(0, n), key).status()))
        << "length " << n;
  }
}

// A manifest or owner record made with another key (another cluster, or
// someone who can write the store but holds no key) is never accepted, nor
// are bytes signed for one purpose accepted as another.
TEST(RemoteLayout, OnlyWhatTheClusterKeySignedIsAccepted) {
  store::RemoteManifest m;
  m.set_job_id("victim");
  m.set_owner_uid(4242);
  const RemoteKey key = TestKey('k');
  const RemoteKey other = TestKey('x');
  const std::string forged = EncodeManifest(m, other);
  absl::StatusOr<store::RemoteManifest> got = DecodeManifest(forged, key);
  EXPECT_TRUE(absl::IsDataLoss(got.status())) << got.status();
  EXPECT_NE(got.status().message().find("remote_key_file"), absl::string_view::npos)
      << got.status();
  // An owner record carries the same body bytes a manifest could: the
  // purposes keep them apart.
  store::RemoteJob job;
  job.set_job_id("victim");
  job.set_owner_uid(4243);
  const std::string owner = EncodeOwner(job, key);
  ASSERT_TRUE(DecodeOwner(owner, key).ok());
  EXPECT_EQ(DecodeOwner(owner, key)->owner_uid(), 4243u);
  EXPECT_TRUE(absl::IsDataLoss(DecodeOwner(owner, other).status()));
  EXPECT_TRUE(absl::IsDataLoss(DecodeManifest(owner, key).status()));
  EXPECT_FALSE(key.Verify("manifest", "abc", key.Mac("object", "abc")));
  EXPECT_TRUE(key.Verify("object", "abc", key.Mac("object", "abc")));
  // A manifest of the format before the MAC (version 1) says so.
  std::string v1 = EncodeManifest(m, key);
  v1[7] = '\1';
  absl::StatusOr<store::RemoteManifest> old = DecodeManifest(v1, key);
  EXPECT_TRUE(absl::IsDataLoss(old.status()));
  EXPECT_NE(old.status().message().find("older ckptd"), absl::string_view::npos) << old.status();
}

// The key file is a secret: refused when others may read it, when it is a
// link or a FIFO (which must not block), or too short.
TEST(RemoteKey, FromFileRefusesWhatIsNotASecretFile) {
  ckpt::testing::TempDir dir;
  const std::string good = dir.Join("key");
  ckpt::testing::WriteFile(good, std::string(44, 'a') + "\n");
  ASSERT_EQ(chmod(good.c_str(), 0600), 0);
  absl::StatusOr<RemoteKey> key = RemoteKey::FromFile(good);
  ASSERT_TRUE(key.ok()) << key.status();
  EXPECT_EQ(key->Mac("object", "x"),
            RemoteKey::FromSecret(std::string(44, 'a'))->Mac("object", "x"));
  ASSERT_EQ(chmod(good.c_str(), 0640), 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(RemoteKey::FromFile(good).status()));
  ASSERT_EQ(chmod(good.c_str(), 0600), 0);
  const std::string link = dir.Join("link");
  ASSERT_EQ(symlink(good.c_str(), link.c_str()), 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(RemoteKey::FromFile(link).status()));
  const std::string fifo = dir.Join("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(RemoteKey::FromFile(fifo).status()));
  const std::string short_key = dir.Join("short");
  ckpt::testing::WriteFile(short_key, "too short");
  ASSERT_EQ(chmod(short_key.c_str(), 0600), 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(RemoteKey::FromFile(short_key).status()));
  EXPECT_TRUE(absl::IsNotFound(RemoteKey::FromFile(dir.Join("none")).status()));
}

// An object's MAC, fed in any pieces, is checked by ForCheck; each object
// gets its own nonce; other bytes, another key or a MAC of no known form
// fail; the HMAC-SHA256 older manifests record is still accepted.
TEST(ObjectMac, ChecksWhatWasFedInAnyPieces) {
  const RemoteKey key = TestKey();
  const std::string bytes = ckpt::testing::RandomBytes(5, 3 << 20);
  auto mac = ObjectMac::Begin(key);
  ASSERT_TRUE(mac.ok()) << mac.status();
  for (size_t off = 0; off < bytes.size(); off += 333333) {
    mac->Update(std::string_view(bytes).substr(off, 333333));
  }
  const std::string recorded = mac->Finish();
  ASSERT_EQ(recorded.size(), ObjectMac::kObjectMacBytes);
  EXPECT_EQ(recorded[0], ObjectMac::kFormat);
  auto check = [&](const RemoteKey& k, std::string_view data, std::string_view rec) {
    absl::StatusOr<ObjectMac> c = ObjectMac::ForCheck(k, rec);
    if (!c.ok()) return false;
    c->Update(data.substr(0, 1000));
    c->Update(data.substr(1000));
    return c->Matches(rec);
  };
  EXPECT_TRUE(check(key, bytes, recorded));
  std::string other = bytes;
  other[12345] ^= 1;
  EXPECT_FALSE(check(key, other, recorded));
  EXPECT_FALSE(check(TestKey('x'), bytes, recorded));
  std::string forged = recorded;
  forged[5] ^= 1;  // another nonce: another one-time key
  EXPECT_FALSE(check(key, bytes, forged));
  auto again = ObjectMac::Begin(key);
  again->Update(bytes);
  EXPECT_NE(again->Finish(), recorded);
  EXPECT_TRUE(absl::IsDataLoss(ObjectMac::ForCheck(key, "short").status()));
  // The legacy form: HMAC-SHA256 under purpose "object".
  EXPECT_TRUE(check(key, bytes, key.Mac("object", bytes)));
  EXPECT_FALSE(check(key, other, key.Mac("object", bytes)));
}

}  // namespace
}  // namespace ckpt::remote
