// Shared-secret authentication: SHA-256, HMAC-SHA256, the handshake proofs, secret loading.
//
// Purpose: peers prove knowledge of a shared secret without sending it (HMAC challenge-response,
// see docs/wire-format.md "Handshake"). SHA-256 (FIPS 180-4) and HMAC (RFC 2104) are implemented
// here so the transport needs no TLS library. The secret is held by Secret, which never prints
// or formats its bytes; loaders report failures without echoing file contents.
//
// Thread-safety: Sha256 objects are not shared between threads; every free function is pure
// (random_nonce() reads the OS random source) and may be called from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "transport/messages.h"
#include "core/status.h"

namespace parapilot::transport {

using Digest = std::array<std::uint8_t, 32>;

/// Incremental SHA-256.
class Sha256 {
 public:
  Sha256();
  void update(std::span<const std::uint8_t> data);
  void update(std::string_view data);
  /// Finishes and returns the digest; the object must not be updated afterwards.
  Digest finish();

 private:
  void block(const std::uint8_t* p);
  std::array<std::uint32_t, 8> h_;
  std::array<std::uint8_t, 64> buf_{};
  std::size_t buf_len_ = 0;
  std::uint64_t total_bytes_ = 0;
};

/// SHA-256 of `data`.
Digest sha256(std::span<const std::uint8_t> data);

/// HMAC-SHA256(key, message) per RFC 2104 (keys longer than 64 bytes are hashed first).
Digest hmac_sha256(std::span<const std::uint8_t> key, std::span<const std::uint8_t> message);

/// Compares two byte strings in time that depends only on their lengths.
bool constant_time_equal(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b);

/// A shared secret. Copyable; its bytes are only reachable through bytes(), never printed.
class Secret {
 public:
  Secret() = default;
  /// Takes the secret bytes (any content; leading/trailing whitespace is kept).
  explicit Secret(std::string bytes) : bytes_(std::move(bytes)) {}
  ~Secret();
  Secret(const Secret&) = default;
  Secret& operator=(const Secret&) = default;
  Secret(Secret&&) noexcept = default;
  Secret& operator=(Secret&&) noexcept = default;

  bool empty() const { return bytes_.empty(); }
  std::size_t size() const { return bytes_.size(); }
  std::span<const std::uint8_t> bytes() const {
    return {reinterpret_cast<const std::uint8_t*>(bytes_.data()), bytes_.size()};
  }

 private:
  std::string bytes_;
};

/// Smallest secret the server and client accept.
inline constexpr std::size_t kMinSecretBytes = 16;

/// Reads a secret from a file; one trailing "\n" or "\r\n" is removed. Fails if the file cannot
/// be read, is open to other users (any of the mode's "other" bits: chmod 600 it), is empty, or
/// is shorter than kMinSecretBytes. The reason names the path, never the content.
StatusOr<Secret> load_secret_from_file(const std::string& path);

/// Reads a secret from environment variable `name` (same rules as the file loader).
StatusOr<Secret> load_secret_from_env(const std::string& name);

/// Fresh random bytes from the operating system (getrandom).
Nonce random_nonce();

/// HMAC-SHA256(secret, "parapilot/1 server" || client_nonce || server_nonce).
Proof server_proof(const Secret& secret, const Nonce& client_nonce, const Nonce& server_nonce);

/// HMAC-SHA256(secret, "parapilot/1 client" || server_nonce || client_nonce).
Proof client_proof(const Secret& secret, const Nonce& server_nonce, const Nonce& client_nonce);

}  // namespace parapilot::transport
