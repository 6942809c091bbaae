#include "daemon/peer/peer_tls.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <openssl/bio.h>
#include <openssl/objects.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "daemon/remote/remote_auth.h"

namespace ckpt::peer {
namespace {

constexpr size_t kMaxPemBytes = 64 << 10;

// Certificates need not be secret, but they are read the key's careful way
// (all three come from LoadCredential=).
absl::StatusOr<std::string> ReadPem(const char* setting, const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(setting, " is not set"));
  CKPT_ASSIGN_OR_RETURN(std::string pem, remote::ReadSecretFile(setting, path, kMaxPemBytes));
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::FailedPreconditionError(absl::StrCat(setting, " ", path, " holds no PEM block"));
  }
  return pem;
}

}  // namespace

absl::StatusOr<PeerTls> PeerTls::FromFiles(const std::string& cert_file,
                                           const std::string& key_file,
                                           const std::string& ca_file) {
  PeerTls t;
  CKPT_ASSIGN_OR_RETURN(t.cert_pem, ReadPem("peer_cert_file", cert_file));
  CKPT_ASSIGN_OR_RETURN(t.key_pem, ReadPem("peer_tls_key_file", key_file));
  CKPT_ASSIGN_OR_RETURN(t.ca_pem, ReadPem("peer_ca_file", ca_file));
  return t;
}

std::shared_ptr<grpc::ServerCredentials> PeerTls::ServerCredentials() const {
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = ca_pem;
  o.pem_key_cert_pairs.push_back({key_pem, cert_pem});
  return grpc::SslServerCredentials(o);
}

std::shared_ptr<grpc::ChannelCredentials> PeerTls::ChannelCredentials() const {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ca_pem;
  o.pem_private_key = key_pem;
  o.pem_cert_chain = cert_pem;
  return grpc::SslCredentials(o);
}

std::string PeerTls::CommonName() const {
  BIO* bio = BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size()));
  if (bio == nullptr) return "";
  X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  if (cert == nullptr) return "";
  char name[256] = {};
  const int n =
      X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, name, sizeof(name));
  X509_free(cert);
  return n > 0 ? std::string(name, static_cast<size_t>(n)) : "";
}

}  // namespace ckpt::peer
