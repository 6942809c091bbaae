// PeerTls: the mutual-TLS identity of this ckptd towards its peers
// (docs/peer.md): its certificate and key, and the CA that signs every
// node's certificate. A peer is known by the common name of its
// certificate; the files are credential files (LoadCredential=).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace grpc {
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace ckpt::peer {

struct PeerTls {
  std::string cert_pem;  // this node's certificate chain
  std::string key_pem;   // its private key
  std::string ca_pem;    // the CA that signs the cluster's certificates

  // Reads the three PEM files; the key file must be a credential file
  // (ReadSecretFile: mode 0600, not a link).
  static absl::StatusOr<PeerTls> FromFiles(const std::string& cert_file,
                                           const std::string& key_file, const std::string& ca_file);
  // The server side: a client certificate the CA signed is required.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  // The client side: presents this node's certificate, checks the server's.
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;
  // The common name of this node's certificate (the first of the chain):
  // the node's name among its peers. "" when it has none.
  std::string CommonName() const;
};

}  // namespace ckpt::peer
