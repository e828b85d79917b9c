#include "transport/auth.h"

#include <sys/random.h>
#include <sys/stat.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>

namespace parapilot::transport {
namespace {

constexpr std::array<std::uint32_t, 64> kK = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

std::span<const std::uint8_t> as_bytes(std::string_view s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

StatusOr<Secret> check_secret(std::string bytes, const std::string& origin) {
  if (bytes.size() >= 2 && bytes.ends_with("\r\n")) {
    bytes.resize(bytes.size() - 2);
  } else if (!bytes.empty() && bytes.back() == '\n') {
    bytes.pop_back();
  }
  if (bytes.empty()) return Status::invalid_argument("secret from " + origin + " is empty");
  if (bytes.size() < kMinSecretBytes) {
    return Status::invalid_argument("secret from " + origin + " is shorter than " + std::to_string(kMinSecretBytes) +
                 " bytes");
  }
  return Secret(std::move(bytes));
}

Proof proof(const Secret& secret, std::string_view label, const Nonce& a, const Nonce& b) {
  std::array<std::uint8_t, 19 + 2 * kNonceBytes> msg{};
  std::size_t n = 0;
  for (char c : label) msg[n++] = static_cast<std::uint8_t>(c);
  for (auto x : a) msg[n++] = x;
  for (auto x : b) msg[n++] = x;
  return hmac_sha256(secret.bytes(), std::span(msg.data(), n));
}

}  // namespace

Sha256::Sha256()
    : h_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
         0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

void Sha256::block(const std::uint8_t* p) {
  std::array<std::uint32_t, 64> w{};
  for (std::size_t i = 0; i < 16; ++i) {
    w[i] = std::uint32_t{p[4 * i]} << 24 | std::uint32_t{p[4 * i + 1]} << 16 |
           std::uint32_t{p[4 * i + 2]} << 8 | std::uint32_t{p[4 * i + 3]};
  }
  for (std::size_t i = 16; i < 64; ++i) {
    const std::uint32_t s0 = std::rotr(w[i - 15], 7) ^ std::rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const std::uint32_t s1 = std::rotr(w[i - 2], 17) ^ std::rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  std::uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6],
                h = h_[7];
  for (std::size_t i = 0; i < 64; ++i) {
    const std::uint32_t S1 = std::rotr(e, 6) ^ std::rotr(e, 11) ^ std::rotr(e, 25);
    const std::uint32_t ch = (e & f) ^ (~e & g);
    const std::uint32_t t1 = h + S1 + ch + kK[i] + w[i];
    const std::uint32_t S0 = std::rotr(a, 2) ^ std::rotr(a, 13) ^ std::rotr(a, 22);
    const std::uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
    const std::uint32_t t2 = S0 + maj;
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h_[0] += a;
  h_[1] += b;
  h_[2] += c;
  h_[3] += d;
  h_[4] += e;
  h_[5] += f;
  h_[6] += g;
  h_[7] += h;
}

void Sha256::update(std::span<const std::uint8_t> data) {
  total_bytes_ += data.size();
  std::size_t i = 0;
  if (buf_len_ > 0) {
    while (buf_len_ < 64 && i < data.size()) buf_[buf_len_++] = data[i++];
    if (buf_len_ < 64) return;
    block(buf_.data());
    buf_len_ = 0;
  }
  for (; i + 64 <= data.size(); i += 64) block(data.data() + i);
  while (i < data.size()) buf_[buf_len_++] = data[i++];
}

void Sha256::update(std::string_view data) { update(as_bytes(data)); }

Digest Sha256::finish() {
  const std::uint64_t bits = total_bytes_ * 8;
  const std::uint8_t pad0 = 0x80;
  update(std::span(&pad0, 1));
  const std::uint8_t zero = 0;
  while (buf_len_ != 56) update(std::span(&zero, 1));
  std::array<std::uint8_t, 8> len{};
  for (std::size_t i = 0; i < 8; ++i) len[i] = static_cast<std::uint8_t>(bits >> (56 - 8 * i));
  update(len);
  Digest out{};
  for (std::size_t i = 0; i < 8; ++i) {
    out[4 * i] = static_cast<std::uint8_t>(h_[i] >> 24);
    out[4 * i + 1] = static_cast<std::uint8_t>(h_[i] >> 16);
    out[4 * i + 2] = static_cast<std::uint8_t>(h_[i] >> 8);
    out[4 * i + 3] = static_cast<std::uint8_t>(h_[i]);
  }
  return out;
}

Digest sha256(std::span<const std::uint8_t> data) {
  Sha256 s;
  s.update(data);
  return s.finish();
}

Digest hmac_sha256(std::span<const std::uint8_t> key, std::span<const std::uint8_t> message) {
  std::array<std::uint8_t, 64> k{};
  if (key.size() > 64) {
    const Digest d = sha256(key);
    std::copy(d.begin(), d.end(), k.begin());
  } else {
    std::copy(key.begin(), key.end(), k.begin());
  }
  std::array<std::uint8_t, 64> ipad{}, opad{};
  for (std::size_t i = 0; i < 64; ++i) {
    ipad[i] = static_cast<std::uint8_t>(k[i] ^ 0x36u);
    opad[i] = static_cast<std::uint8_t>(k[i] ^ 0x5cu);
  }
  Sha256 inner;
  inner.update(ipad);
  inner.update(message);
  const Digest ih = inner.finish();
  Sha256 outer;
  outer.update(opad);
  outer.update(ih);
  const Digest out = outer.finish();
  k.fill(0);
  ipad.fill(0);
  opad.fill(0);
  return out;
}

bool constant_time_equal(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) {
  if (a.size() != b.size()) return false;
  volatile std::uint8_t diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff = static_cast<std::uint8_t>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

Secret::~Secret() {
  // Best-effort wipe before the memory is released.
  volatile char* p = bytes_.data();
  for (std::size_t i = 0; i < bytes_.size(); ++i) p[i] = 0;
}

StatusOr<Secret> load_secret_from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::not_found("cannot read secret file '" + path + "'");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & S_IRWXO) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status::invalid_argument("secret file '" + path + "' is open to other users (mode " +
                                    mode + "): make it private with chmod 600 '" + path + "'");
  }
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return Status::not_found("cannot read secret file '" + path + "'");
  return check_secret(std::move(bytes), "file '" + path + "'");
}

StatusOr<Secret> load_secret_from_env(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return Status::not_found("environment variable " + name + " is not set");
  return check_secret(std::string(v), "environment variable " + name);
}

Nonce random_nonce() {
  Nonce n{};
  std::size_t got = 0;
  while (got < n.size()) {
    const ssize_t r = getrandom(n.data() + got, n.size() - got, 0);
    if (r > 0) {
      got += static_cast<std::size_t>(r);
    } else if (r < 0 && errno != EINTR) {
      break;
    }
  }
  if (got < n.size()) {
    std::random_device rd;  // fallback; still non-deterministic
    for (auto& b : n) b = static_cast<std::uint8_t>(rd());
  }
  return n;
}

Proof server_proof(const Secret& secret, const Nonce& client_nonce, const Nonce& server_nonce) {
  return proof(secret, "parapilot/1 server", client_nonce, server_nonce);
}

Proof client_proof(const Secret& secret, const Nonce& server_nonce, const Nonce& client_nonce) {
  return proof(secret, "parapilot/1 client", server_nonce, client_nonce);
}

}  // namespace parapilot::transport
