// The SigV4 signer on fixed requests: the encodings of the canonical request,
// and the signatures of AWS's published S3 examples (access key
// AKIAIOSFODNN7EXAMPLE, bucket examplebucket, 2013-05-24 00:00:00 UTC).
// tests/daemon/remote/test_sigv4_botocore.py compares many more requests with botocore.
#include "daemon/remote/sigv4.h"

#include <string>

#include "absl/time/civil_time.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace ckpt::remote {
namespace {

constexpr char kExampleDate[] = "20130524T000000Z";
constexpr char kExampleHost[] = "examplebucket.s3.amazonaws.com";

SigV4Credentials ExampleCredentials() {
  return {"AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", ""};
}

std::string SignatureOf(const std::string& authorization) {
  const size_t at = authorization.find("Signature=");
  return at == std::string::npos ? "" : authorization.substr(at + 10);
}

std::string HeaderValue(const SigV4Signed& s, const std::string& name) {
  for (const auto& [n, v] : s.headers) {
    if (n == name) return v;
  }
  return "<absent>";
}

TEST(Sha256Test, KnownDigests) {
  EXPECT_EQ(Sha256Hex(""), kEmptySha256);
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex("Welcome to Amazon S3."),
            "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
}

TEST(Sha256Test, HmacRfc4231Case2) {
  EXPECT_EQ(HexEncode(HmacSha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(SigV4EncodingTest, AmzDateIsUtcWithoutSeparators) {
  const absl::Time t = absl::FromCivil(absl::CivilSecond(2026, 1, 2, 3, 4, 5), absl::UTCTimeZone());
  EXPECT_EQ(AmzDate(t), "20260102T030405Z");
}

TEST(SigV4EncodingTest, PathKeepsUnreservedAndSlash) {
  EXPECT_EQ(UriEncode("/bucket/a-b_c.d~e/F9", true), "/bucket/a-b_c.d~e/F9");
  EXPECT_EQ(UriEncode("/b/a b+c*d$e=f", true), "/b/a%20b%2Bc%2Ad%24e%3Df");
  EXPECT_EQ(UriEncode("/b/caf\xc3\xa9", true), "/b/caf%C3%A9");
  EXPECT_EQ(UriEncode("/b//./../x", true), "/b//./../x");  // S3 does not normalize
}

TEST(SigV4EncodingTest, QueryEncodesSlashAndSortsByEncodedKeyThenValue) {
  EXPECT_EQ(UriEncode("a/b=c+d", false), "a%2Fb%3Dc%2Bd");
  const QueryList query = {{"prefix", "ckpt/x y"},
                           {"uploads", ""},
                           {"list-type", "2"},
                           {"continuation-token", "1/abc+=="},
                           {"b", "2"},
                           {"b", "1"}};
  EXPECT_EQ(CanonicalQueryString(query),
            "b=1&b=2&continuation-token=1%2Fabc%2B%3D%3D&list-type=2&prefix=ckpt%2Fx%20y&"
            "uploads=");
  EXPECT_EQ(CanonicalQueryString({}), "");
}

TEST(SigV4EncodingTest, HeadersLowercasedTrimmedSortedAndJoined) {
  SigV4Request r;
  r.method = "put";
  r.path = "/b/k";
  r.headers = {{"Host", "127.0.0.1:7480"},
               {"X-Custom", "  a   b\t c  "},
               {"x-custom", "second"},
               {"If-None-Match", "*"},
               {"X-Amz-Date", "dropped"}};
  r.payload_sha256 = std::string(kUnsignedPayload);
  auto s = SignV4(r, ExampleCredentials(), "us-east-1", "s3", kExampleDate);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->canonical_request,
            "PUT\n/b/k\n\n"
            "host:127.0.0.1:7480\n"
            "if-none-match:*\n"
            "x-amz-content-sha256:UNSIGNED-PAYLOAD\n"
            "x-amz-date:20130524T000000Z\n"
            "x-custom:a b c,second\n"
            "\n"
            "host;if-none-match;x-amz-content-sha256;x-amz-date;x-custom\n"
            "UNSIGNED-PAYLOAD");
  EXPECT_EQ(HeaderValue(*s, "x-amz-date"), kExampleDate);
  EXPECT_EQ(HeaderValue(*s, "authorization"), s->authorization);
}

TEST(SigV4EncodingTest, SessionTokenIsSentAndSigned) {
  SigV4Request r;
  r.method = "GET";
  r.path = "/b/k";
  r.headers = {{"host", "h"}};
  r.payload_sha256 = std::string(kEmptySha256);
  SigV4Credentials c = ExampleCredentials();
  c.session_token = "token/with+chars";
  auto s = SignV4(r, c, "us-east-1", "s3", kExampleDate);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(HeaderValue(*s, "x-amz-security-token"), "token/with+chars");
  EXPECT_NE(s->authorization.find("SignedHeaders=host;x-amz-content-sha256;x-amz-date;"
                                  "x-amz-security-token,"),
            std::string::npos)
      << s->authorization;
}

TEST(SigV4EncodingTest, RefusesIncompleteRequestsWithoutEchoingSecrets) {
  SigV4Request r;
  r.method = "GET";
  r.path = "/";
  r.payload_sha256 = std::string(kEmptySha256);
  auto no_host = SignV4(r, ExampleCredentials(), "us-east-1", "s3", kExampleDate);
  EXPECT_EQ(no_host.status().code(), absl::StatusCode::kInvalidArgument);
  r.headers = {{"host", "h"}};
  EXPECT_EQ(SignV4(r, ExampleCredentials(), "us-east-1", "s3", "2013-05-24").status().code(),
            absl::StatusCode::kInvalidArgument);
  SigV4Credentials no_secret = ExampleCredentials();
  no_secret.secret_access_key.clear();
  auto s = SignV4(r, no_secret, "us-east-1", "s3", kExampleDate);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(std::string(s.status().message()).find("AKIA"), std::string::npos);
}

// AWS S3 documentation, "Example: GET Object".
TEST(SigV4KnownAnswerTest, GetObjectWithRange) {
  SigV4Request r;
  r.method = "GET";
  r.path = "/test.txt";
  r.headers = {{"Host", kExampleHost}, {"Range", "bytes=0-9"}};
  r.payload_sha256 = std::string(kEmptySha256);
  auto s = SignV4(r, ExampleCredentials(), "us-east-1", "s3", kExampleDate);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->canonical_request,
            "GET\n/test.txt\n\n"
            "host:examplebucket.s3.amazonaws.com\n"
            "range:bytes=0-9\n"
            "x-amz-content-sha256:"
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n"
            "x-amz-date:20130524T000000Z\n"
            "\n"
            "host;range;x-amz-content-sha256;x-amz-date\n"
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(s->string_to_sign,
            "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
            "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972");
  EXPECT_EQ(s->authorization,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/"
            "aws4_request, SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

// AWS S3 documentation, "Example: PUT Object" (a '$' in the key).
TEST(SigV4KnownAnswerTest, PutObjectWithStorageClass) {
  SigV4Request r;
  r.method = "PUT";
  r.path = "/test$file.text";
  r.headers = {{"Host", kExampleHost},
               {"Date", "Fri, 24 May 2013 00:00:00 GMT"},
               {"x-amz-storage-class", "REDUCED_REDUNDANCY"}};
  r.payload_sha256 = Sha256Hex("Welcome to Amazon S3.");
  auto s = SignV4(r, ExampleCredentials(), "us-east-1", "s3", kExampleDate);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NE(s->canonical_request.find("PUT\n/test%24file.text\n\n"), std::string::npos);
  EXPECT_EQ(SignatureOf(s->authorization),
            "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd");
}

// AWS S3 documentation, "Example: GET Bucket Lifecycle" (a parameter without a value).
TEST(SigV4KnownAnswerTest, GetBucketLifecycle) {
  SigV4Request r;
  r.method = "GET";
  r.path = "/";
  r.query = {{"lifecycle", ""}};
  r.headers = {{"Host", kExampleHost}};
  r.payload_sha256 = std::string(kEmptySha256);
  auto s = SignV4(r, ExampleCredentials(), "us-east-1", "s3", kExampleDate);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(SignatureOf(s->authorization),
            "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543");
}

// AWS S3 documentation, "Example: Get Bucket (List Objects)".
TEST(SigV4KnownAnswerTest, ListObjects) {
  SigV4Request r;
  r.method = "GET";
  r.path = "";
  r.query = {{"prefix", "J"}, {"max-keys", "2"}};
  r.headers = {{"Host", kExampleHost}};
  r.payload_sha256 = std::string(kEmptySha256);
  auto s = SignV4(r, ExampleCredentials(), "us-east-1", "s3", kExampleDate);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(SignatureOf(s->authorization),
            "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7");
}

}  // namespace
}  // namespace ckpt::remote
