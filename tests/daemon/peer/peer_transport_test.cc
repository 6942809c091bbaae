// The replica service and the peer tier's transport over loopback, with
// mutual TLS: certificates openssl makes for the test.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/unique_fd.h"
#include "daemon/common/sync_point.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/peer_store.h"
#include "daemon/peer/replica.grpc.pb.h"
#include "daemon/peer/replica_server.h"
#include "daemon/peer/replica_store.h"
#include "daemon/remote/remote_layout.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt::peer {
namespace {

using ::ckpt::testing::HasCode;
using ::ckpt::testing::RandomBytes;
using ::ckpt::testing::TempDir;

// A CA and the certificates it signs, in `dir`.
class Pki {
 public:
  Pki(const TempDir& dir, const std::string& ca) : dir_(dir), ca_(ca) {
    Run(
        absl::StrCat("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
                     "-keyout ",
                     Path(ca_ + ".key"), " -out ", Path(ca_ + ".pem"), " -days 2 -subj /CN=", ca_));
  }
  // This node's TLS identity as `cn`.
  PeerTls Issue(const std::string& cn) {
    const std::string ext = Path(cn + ".ext");
    Run(absl::StrCat("printf 'subjectAltName=DNS:", cn,
                     "\\nextendedKeyUsage=serverAuth,clientAuth\\n' > ", ext));
    Run(absl::StrCat("openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ",
                     Path(cn + ".key"), " -out ", Path(cn + ".csr"), " -subj /CN=", cn));
    Run(absl::StrCat("openssl x509 -req -in ", Path(cn + ".csr"), " -CA ", Path(ca_ + ".pem"),
                     " -CAkey ", Path(ca_ + ".key"), " -CAcreateserial -days 2 -out ",
                     Path(cn + ".pem"), " -extfile ", ext));
    for (const char* f : {".key", ".pem"}) chmod(Path(cn + f).c_str(), 0600);
    chmod(Path(ca_ + ".pem").c_str(), 0600);
    absl::StatusOr<PeerTls> tls =
        PeerTls::FromFiles(Path(cn + ".pem"), Path(cn + ".key"), Path(ca_ + ".pem"));
    EXPECT_TRUE(tls.ok()) << tls.status();
    return tls.ok() ? *tls : PeerTls();
  }

 private:
  std::string Path(const std::string& name) const { return dir_.Join(name); }
  static void Run(const std::string& cmd) {
    ASSERT_EQ(std::system((cmd + " >/dev/null 2>&1").c_str()), 0) << cmd;
  }
  const TempDir& dir_;
  const std::string ca_;
};

class PeerTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ReplicaStoreOptions so;
    so.dir = dir_.Join("replicas");
    so.memory_bytes = 1 << 20;
    so.max_bytes = 16 << 20;
    so.max_bytes_per_peer = 8 << 20;
    so.max_object_bytes = 8 << 20;
    so.key = &key_;
    auto store = ReplicaStore::Open(so);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    ReplicaServerOptions ro;
    ro.listen = "127.0.0.1:0";
    ro.tls = pki_.Issue("node-b");
    ro.allowed_peers = {"node-a"};
    ro.chunk_bytes = 64 << 10;  // many chunks per object
    auto server = ReplicaServer::Start(ro, store_.get(), nullptr);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  std::unique_ptr<PeerStore> Client(PeerTls tls, const std::string& server_name = "node-b") {
    PeerStoreOptions o;
    o.address = absl::StrCat("127.0.0.1:", server_->port());
    o.server_name = server_name;
    o.tls = std::move(tls);
    o.call_timeout = absl::Seconds(5);
    o.chunk_bytes = 64 << 10;
    return std::make_unique<PeerStore>(o);
  }

  TempDir dir_;
  Pki pki_{dir_, "cluster-ca"};
  const remote::RemoteKey key_ = *remote::RemoteKey::FromSecret(std::string(32, 'k'));
  std::unique_ptr<ReplicaStore> store_;
  std::unique_ptr<ReplicaServer> server_;
};

TEST_F(PeerTransportTest, AnAllowedPeerPutsGetsListsAndDeletes) {
  std::unique_ptr<PeerStore> a = Client(pki_.Issue("node-a"));
  store::RemoteJob owner;
  owner.set_job_id("j");
  owner.set_owner_uid(1001);
  const std::string small = remote::EncodeOwner(owner, key_);
  const std::string big = RandomBytes(7, (6 << 20) + 12345);  // past the memory budget, via a file
  ASSERT_TRUE(a->PutBytes("jobs/j/owner", small, /*if_absent=*/true).ok());
  EXPECT_TRUE(HasCode(a->PutBytes("jobs/j/owner", "x", true), absl::StatusCode::kAlreadyExists));
  const std::string path = dir_.Join("version");
  {
    // The first big.size() bytes of a longer file, read once (O_DIRECT on
    // this file system) for the stream and the observer together.
    UniqueFd fd(open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600));
    const std::string file = big + "not sent";
    ASSERT_EQ(pwrite(fd.get(), file.data(), file.size(), 0), static_cast<ssize_t>(file.size()));
    std::string seen;
    ASSERT_TRUE(a->PutFileObserved("jobs/j/rank-00000000/v1", fd.get(), big.size(),
                                   [&](std::string_view b) {
                                     seen.append(b);
                                     return absl::OkStatus();
                                   })
                    .ok());
    EXPECT_TRUE(seen == big);
    // An observer's error ends the transfer, and nothing is stored.
    EXPECT_TRUE(
        HasCode(a->PutFileObserved("jobs/j/rank-00000000/v2", fd.get(), big.size(),
                                   [](std::string_view) { return absl::DataLossError("stop"); }),
                absl::StatusCode::kDataLoss));
  }
  EXPECT_EQ(*a->GetBytes("jobs/j/owner", 1 << 20), small);
  EXPECT_EQ(store_->Totals().disk_bytes, small.size() + big.size());
  EXPECT_EQ(store_->Totals().memory_bytes, small.size());
  UniqueFd out(open(dir_.Join("pulled").c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600));
  std::string arrived;
  absl::StatusOr<uint64_t> n =
      a->GetToFileObserved("jobs/j/rank-00000000/v1", out.get(), 16 << 20, [&](std::string_view b) {
        arrived.append(b);
        return absl::OkStatus();
      });
  ASSERT_TRUE(n.ok()) << n.status();
  ASSERT_EQ(*n, big.size());
  EXPECT_TRUE(arrived == big);
  std::string back(big.size(), '\0');
  ASSERT_EQ(pread(out.get(), back.data(), back.size(), 0), static_cast<ssize_t>(big.size()));
  EXPECT_EQ(back, big);
  EXPECT_TRUE(
      HasCode(a->GetBytes("jobs/j/rank-00000000/v1", 100), absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(HasCode(a->GetBytes("jobs/j/rank-00000000/none", 100), absl::StatusCode::kNotFound));
  auto listed = a->List("jobs/j/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[1].size, big.size());
  ASSERT_TRUE(a->Delete("jobs/j/rank-00000000/v1").ok());
  EXPECT_EQ(store_->Totals().disk_bytes, small.size());
  EXPECT_TRUE(HasCode(a->PutBytes("../escape", "x", false), absl::StatusCode::kInvalidArgument));
}

// An object whose bytes are filled in as they go (the memory tier's image
// of a version): each message's piece asked for in order, shown to the
// observer, stored whole; a filler's error or a piece of another size ends
// the transfer with nothing stored.
TEST_F(PeerTransportTest, AFilledObjectIsSentPieceByPiece) {
  std::unique_ptr<PeerStore> a = Client(pki_.Issue("node-a"));
  store::RemoteJob owner;
  owner.set_job_id("j");
  owner.set_owner_uid(1001);
  ASSERT_TRUE(a->PutBytes("jobs/j/owner", remote::EncodeOwner(owner, key_), true).ok());
  const std::string big = RandomBytes(9, (1 << 20) + 777);
  EXPECT_TRUE(a->PutsFromMemory());
  uint64_t next = 0;
  std::string seen;
  absl::Status put = a->PutFilledObserved(
      "jobs/j/rank-00000000/v1", big.size(),
      [&](uint64_t off, size_t n, std::string* out) {
        if (off != next) return absl::InternalError("out of order");
        next = off + n;
        out->assign(big, off, n);
        return absl::OkStatus();
      },
      [&](std::string_view b) {
        seen.append(b);
        return absl::OkStatus();
      });
  ASSERT_TRUE(put.ok()) << put;
  EXPECT_EQ(next, big.size());
  EXPECT_TRUE(seen == big);
  absl::StatusOr<std::string> back = a->GetBytes("jobs/j/rank-00000000/v1", 16 << 20);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == big);
  auto none = [](std::string_view) { return absl::OkStatus(); };
  EXPECT_TRUE(HasCode(a->PutFilledObserved(
                          "jobs/j/rank-00000000/v2", big.size(),
                          [](uint64_t off, size_t, std::string* out) {
                            out->assign(10, 'x');
                            return off == 0 ? absl::OkStatus() : absl::DataLossError("gone");
                          },
                          none),
                      absl::StatusCode::kInternal));
  EXPECT_TRUE(
      HasCode(a->PutFilledObserved(
                  "jobs/j/rank-00000000/v3", big.size(),
                  [](uint64_t, size_t, std::string*) { return absl::DataLossError("gone"); }, none),
              absl::StatusCode::kDataLoss));
  EXPECT_TRUE(HasCode(a->GetBytes("jobs/j/rank-00000000/v2", 16 << 20).status(),
                      absl::StatusCode::kNotFound));
  EXPECT_TRUE(HasCode(a->GetBytes("jobs/j/rank-00000000/v3", 16 << 20).status(),
                      absl::StatusCode::kNotFound));
}

TEST_F(PeerTransportTest, APeerPastItsShareIsToldTheStoreIsFull) {
  std::unique_ptr<PeerStore> a = Client(pki_.Issue("node-a"));
  ASSERT_TRUE(a->PutBytes("jobs/j/rank-00000000/a", std::string(6 << 20, 'a'), false).ok());
  absl::Status s = a->PutBytes("jobs/j/rank-00000000/b", std::string(3 << 20, 'b'), false);
  EXPECT_TRUE(HasCode(s, absl::StatusCode::kResourceExhausted)) << s;
  EXPECT_TRUE(
      HasCode(store_->Get("jobs/j/rank-00000000/b", 16 << 20), absl::StatusCode::kNotFound));
}

// Stopping ends a transfer at once, even one waiting out the rate cap for
// many minutes; later calls run as usual.
TEST_F(PeerTransportTest, CancelCallsEndsATransferInFlight) {
  PeerStoreOptions o;
  o.address = absl::StrCat("127.0.0.1:", server_->port());
  o.server_name = "node-b";
  o.tls = pki_.Issue("node-a");
  o.chunk_bytes = 64 << 10;
  o.rate_bytes_per_s = 1024;  // the second chunk would wait a minute
  PeerStore a(o);
  SyncPoint* sp = SyncPoint::GetInstance();
  sp->EnableProcessing();
  absl::Status put;
  std::thread t(
      [&] { put = a.PutBytes("jobs/j/rank-00000000/slow", std::string(128 << 10, 's'), false); });
  const bool pacing = sp->WaitForArrivals("peer.before_pace", 2, absl::Now() + absl::Seconds(30));
  a.CancelCalls();
  t.join();
  sp->DisableProcessing();
  ASSERT_TRUE(pacing);
  EXPECT_TRUE(HasCode(put, absl::StatusCode::kCancelled)) << put;
  EXPECT_TRUE(
      HasCode(store_->Get("jobs/j/rank-00000000/slow", 1 << 20), absl::StatusCode::kNotFound));
  EXPECT_TRUE(a.PutBytes("jobs/j/rank-00000000/small", "x", false).ok());
}

TEST_F(PeerTransportTest, AnUnknownPeerIsRefusedAndNothingIsStored) {
  std::unique_ptr<PeerStore> z = Client(pki_.Issue("node-z"));
  absl::Status s = z->PutBytes("jobs/j/owner", "mine", false);
  EXPECT_TRUE(HasCode(s, absl::StatusCode::kPermissionDenied)) << s;
  EXPECT_NE(s.message().find("node-z is not allowed"), std::string::npos) << s;
  EXPECT_TRUE(HasCode(z->List(""), absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(store_->Totals().objects, 0u);
}

// The client trusts the cluster's CA (so it accepts the server), but its own
// certificate, of an allowed name, another CA signed: the server refuses it.
TEST_F(PeerTransportTest, ACertificateOfAnotherCaIsRefused) {
  Pki other(dir_, "other-ca");
  PeerTls evil_tls = other.Issue("node-a");
  evil_tls.ca_pem = pki_.Issue("node-a").ca_pem;
  std::unique_ptr<PeerStore> evil = Client(evil_tls);
  absl::Status s = evil->PutBytes("jobs/j/owner", "mine", false);
  EXPECT_TRUE(HasCode(s, absl::StatusCode::kUnavailable)) << s;
  EXPECT_EQ(store_->Totals().objects, 0u);
}

TEST_F(PeerTransportTest, AServerWithAnotherNameIsNotTrusted) {
  std::unique_ptr<PeerStore> a = Client(pki_.Issue("node-a"), /*server_name=*/"node-q");
  absl::Status s = a->PutBytes("jobs/j/owner", "mine", false);
  EXPECT_TRUE(HasCode(s, absl::StatusCode::kUnavailable)) << s;
  EXPECT_EQ(store_->Totals().objects, 0u);
}

// A List is answered a page at a time, however many objects there are, and
// the client follows the pages to the end, in key order.
TEST_F(PeerTransportTest, ListsComeInPages) {
  ReplicaServerOptions ro;
  ro.listen = "127.0.0.1:0";
  ro.tls = pki_.Issue("node-b");
  ro.list_page = 7;
  auto server = ReplicaServer::Start(ro, store_.get(), nullptr);
  ASSERT_TRUE(server.ok()) << server.status();
  PeerStoreOptions o;
  o.address = absl::StrCat("127.0.0.1:", (*server)->port());
  o.server_name = "node-b";
  o.tls = pki_.Issue("node-a");
  PeerStore a(o);
  std::vector<std::string> keys;
  for (int i = 0; i < 25; ++i) {
    keys.push_back(absl::StrCat("jobs/j/rank-00000000/v/", 100 + i));
    ASSERT_TRUE(a.PutBytes(keys.back(), "x", false).ok());
  }
  ASSERT_TRUE(a.PutBytes("jobs/k/rank-00000000/v/other", "y", false).ok());
  auto listed = a.List("jobs/j/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<std::string> got;
  for (const remote::ObjectInfo& i : *listed) got.push_back(i.key);
  EXPECT_EQ(got, keys);
}

// A peer that stops sending in the middle of a Put (here: a client held
// at its pacing) is cancelled by the server once nothing moved for
// idle_timeout, whatever the deadline it set; nothing is stored.
TEST_F(PeerTransportTest, AnIdleCallIsCancelled) {
  Metrics metrics;
  ReplicaServerOptions ro;
  ro.listen = "127.0.0.1:0";
  ro.tls = pki_.Issue("node-b");
  ro.idle_timeout = absl::Milliseconds(200);
  auto server = ReplicaServer::Start(ro, store_.get(), &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  PeerStoreOptions o;
  o.address = absl::StrCat("127.0.0.1:", (*server)->port());
  o.server_name = "node-b";
  o.tls = pki_.Issue("node-a");
  o.chunk_bytes = 64 << 10;
  o.call_timeout = absl::Minutes(10);
  PeerStore a(o);
  auto idle_refused = [&metrics] {
    return absl::StrContains(metrics.Scrape(),
                             "ckpt_peer_replica_refused_total{reason=\"idle\"} 1");
  };
  SyncPoint* sp = SyncPoint::GetInstance();
  std::atomic<int> paced{0};
  std::atomic<bool> seen{false};
  // The second chunk waits until the server has given up on the call.
  sp->SetCallBack("peer.before_pace", [&](void*) {
    if (paced.fetch_add(1) != 1) return;
    for (absl::Time deadline = absl::Now() + absl::Seconds(30); absl::Now() < deadline;) {
      if (idle_refused()) {
        seen = true;
        return;
      }
      absl::SleepFor(absl::Milliseconds(10));  // a poll with a deadline
    }
  });
  sp->EnableProcessing();
  const absl::Status put =
      a.PutBytes("jobs/j/rank-00000000/stalled", std::string(128 << 10, 's'), false);
  sp->DisableProcessing();
  sp->ClearAllCallBacks();
  EXPECT_TRUE(seen);
  EXPECT_TRUE(HasCode(put, absl::StatusCode::kCancelled)) << put;
  EXPECT_TRUE(
      HasCode(store_->Get("jobs/j/rank-00000000/stalled", 1 << 20), absl::StatusCode::kNotFound));
  EXPECT_TRUE(a.PutBytes("jobs/j/rank-00000000/after", "x", false).ok());
}

// A peer that opens a Put and never sends its first message is cancelled
// by the server as one that stops half-way is (it once held a server
// thread until the deadline the peer itself chose).
TEST_F(PeerTransportTest, APutThatSendsNothingIsCancelled) {
  Metrics metrics;
  ReplicaServerOptions ro;
  ro.listen = "127.0.0.1:0";
  ro.tls = pki_.Issue("node-b");
  ro.idle_timeout = absl::Milliseconds(200);
  auto server = ReplicaServer::Start(ro, store_.get(), &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  const PeerTls tls = pki_.Issue("node-a");
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("node-b");
  auto stub = v1::Replica::NewStub(grpc::CreateCustomChannel(
      absl::StrCat("127.0.0.1:", (*server)->port()), tls.ChannelCredentials(), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::PutReply reply;
  const absl::Time start = absl::Now();
  std::unique_ptr<grpc::ClientWriter<v1::PutChunk>> writer = stub->Put(&ctx, &reply);
  const grpc::Status s = writer->Finish();  // no message sent, no WritesDone
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "held until the peer's own deadline";
  EXPECT_TRUE(
      absl::StrContains(metrics.Scrape(), "ckpt_peer_replica_refused_total{reason=\"idle\"} 1"));
}

}  // namespace
}  // namespace ckpt::peer
