// The training worker (libtorch): model, data, collectives, the training loop.
#include "env/live/worker.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <memory>
#include <sstream>
#include <thread>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "env/live/grad_sync.h"
#include "env/live/worker_bus.h"
#include "env/trace/telemetry.h"
#include "strategy/error.h"
#ifdef PARAPILOT_HAVE_NCCL
#include "env/live/nccl_comm.h"
#endif

namespace parapilot::live {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::uint64_t wall_ns() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// ---- corpus ------------------------------------------------------------------------------

std::string generated_corpus() {
  // Deterministic English-like text about the project's own subject.
  static const char* const kWords[] = {
      "the",         "rank",   "layout",  "gradient",   "pipeline", "stage",      "tensor",
      "parallel",    "batch",  "share",   "slow",       "link",     "all-reduce", "bucket",
      "compression", "agent",  "policy",  "throughput", "step",     "telemetry",  "plan",
      "commit",      "of",     "and",     "a",          "to",       "is",         "when",
      "every",       "faster", "cluster", "worker",     "model",    "token",      "bytes",
      "train",       "with",   "on"};
  constexpr std::size_t n = sizeof kWords / sizeof kWords[0];
  std::string out;
  std::uint64_t s = 12345;
  while (out.size() < (1u << 18)) {
    const int words = 5 + static_cast<int>((s = splitmix64(s)) % 10);
    for (int w = 0; w < words; ++w) {
      // Zipf-like choice: low indices are more frequent; a word depends on the previous one.
      s = splitmix64(s);
      const std::size_t i = (s % n) * (s % n) / n;
      std::string word = kWords[i];
      if (w == 0) word[0] = static_cast<char>(std::toupper(word[0]));
      out += word;
      out += w + 1 == words ? ".\n" : " ";
    }
  }
  return out;
}

std::string load_corpus(const std::string& path) {
  if (path.empty()) return generated_corpus();
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> files;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::recursive_directory_iterator(path, ec)) {
      const std::string ext = e.path().extension().string();
      if (e.is_regular_file() &&
          (ext == ".md" || ext == ".cc" || ext == ".h" || ext == ".txt" || ext == ".toml"))
        files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  } else if (fs::is_regular_file(path, ec)) {
    files.push_back(path);
  } else {
    throw InputError("--corpus '" + path + "': no such file or folder");
  }
  std::string out;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    out += ss.str();
  }
  return out;
}

// ---- models ------------------------------------------------------------------------------

struct BlockImpl : torch::nn::Module {
  BlockImpl(int d, int heads) : heads_(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2);
    const auto dh = d / heads_;
    auto parts = qkv(ln1(x)).chunk(3, -1);
    auto q = parts[0].view({b, t, heads_, dh}).transpose(1, 2);
    auto k = parts[1].view({b, t, heads_, dh}).transpose(1, 2);
    auto v = parts[2].view({b, t, heads_, dh}).transpose(1, 2);
    auto att = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(dh));
    att = att.masked_fill(mask, -1e9).softmax(-1);
    auto y = att.matmul(v).transpose(1, 2).contiguous().view({b, t, d});
    x = x + proj(y);
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t heads_;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

/// Byte-level model: logits [B, T', 256] and the targets they predict [B, T'].
struct LanguageModel : torch::nn::Module {
  explicit LanguageModel(const ModelConfig& c) : cfg(c) {
    const int d = c.d_model;
    if (c.kind == "transformer") {
      pos = register_parameter("pos", torch::randn({c.seq_len, d}) * 0.02);
      tok = register_module("tok", torch::nn::Embedding(ModelConfig::kVocab, d));
      blocks = register_module("blocks", torch::nn::ModuleList());
      for (int i = 0; i < c.layers; ++i) blocks->push_back(Block(d, c.heads));
      lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
      head = register_module("head", torch::nn::Linear(d, ModelConfig::kVocab));
    } else {
      tok = register_module("tok", torch::nn::Embedding(ModelConfig::kVocab, d));
      hidden = register_module("hidden", torch::nn::ModuleList());
      int in = c.context * d;
      for (int i = 0; i < c.layers; ++i) {
        hidden->push_back(torch::nn::Linear(in, 4 * d));
        in = 4 * d;
      }
      head = register_module("head", torch::nn::Linear(in, ModelConfig::kVocab));
    }
  }
  /// Mean cross-entropy of predicting seq[:, 1:] from what precedes it.
  torch::Tensor loss(const torch::Tensor& seq) {
    const auto t = seq.size(1) - 1;
    if (cfg.kind == "transformer") {
      auto input = seq.narrow(1, 0, t);
      auto x = tok(input) + pos.narrow(0, 0, t);
      auto mask = torch::ones({t, t}, torch::kBool).triu(1);
      for (auto& m : *blocks) x = m->as<Block>()->forward(x, mask);
      auto logits = head(lnf(x));
      return torch::nn::functional::cross_entropy(logits.reshape({-1, ModelConfig::kVocab}),
                                                  seq.narrow(1, 1, t).reshape({-1}));
    }
    const int c = cfg.context;
    auto emb = tok(seq.narrow(1, 0, t));  // [B, t, d]
    auto win = emb.unfold(1, c, 1);       // [B, t-c+1, d, c]
    auto x = win.transpose(2, 3).reshape({seq.size(0), t - c + 1, c * cfg.d_model});
    for (auto& m : *hidden) x = torch::gelu(m->as<torch::nn::Linear>()->forward(x));
    auto logits = head(x);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, ModelConfig::kVocab}),
                                                seq.narrow(1, c, t - c + 1).reshape({-1}));
  }
  ModelConfig cfg;
  torch::Tensor pos;
  torch::nn::Embedding tok{nullptr};
  torch::nn::ModuleList blocks{nullptr}, hidden{nullptr};
  torch::nn::LayerNorm lnf{nullptr};
  torch::nn::Linear head{nullptr};
};

// ---- collectives -------------------------------------------------------------------------

class GlooCollectives final : public Collectives {
 public:
  GlooCollectives(c10::intrusive_ptr<c10d::Store> store, int rank, int world, double timeout_s,
                  const std::string& master_addr)
      : rank_(rank), world_(world) {
    auto opts = c10d::ProcessGroupGloo::Options::create(
        std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000)));
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    else if (master_addr == "127.0.0.1" || master_addr == "localhost")
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    else
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    opts->threads = 1;
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, opts);
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Status all_reduce_sum(std::vector<at::Tensor>& tensors) override {
    return run([&] {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (auto& t : tensors) {
        std::vector<at::Tensor> one{t};
        works.push_back(pg_->allreduce(one));
      }
      for (auto& w : works) w->wait();
    });
  }
  Status all_reduce_max(at::Tensor& tensor) override {
    return run([&] {
      std::vector<at::Tensor> one{tensor};
      c10d::AllreduceOptions o;
      o.reduceOp = c10d::ReduceOp::MAX;
      pg_->allreduce(one, o)->wait();
    });
  }
  StatusOr<std::vector<at::Tensor>> all_gather(const at::Tensor& input) override {
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < world_; ++r) out[0].push_back(at::empty_like(input));
    std::vector<at::Tensor> in{input.contiguous()};
    if (Status st = run([&] { pg_->allgather(out, in)->wait(); }); !st.ok()) return st;
    return out[0];
  }
  Status broadcast(std::vector<at::Tensor>& tensors) override {
    return run([&] {
      for (auto& t : tensors) {
        std::vector<at::Tensor> one{t};
        pg_->broadcast(one)->wait();
      }
    });
  }
  std::string backend() const override { return "gloo"; }

 private:
  // Gloo reports a failed or timed-out collective by throwing; here it becomes a Status.
  template <class F>
  static Status run(F&& f) {
    try {
      f();
      return {};
    } catch (const std::exception& e) {
      return Status::collective_failed(std::string("gloo collective failed: ") + e.what());
    }
  }
  int rank_, world_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

#ifdef PARAPILOT_HAVE_NCCL
class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(c10::intrusive_ptr<c10d::Store> store, int rank, int world, int device,
                  double timeout_s)
      : rank_(rank), world_(world) {
    auto set = [store](const std::string& k, const std::vector<std::uint8_t>& v) {
      store->set(k, v);
    };
    auto get = [store](const std::string& k) { return store->get(k); };
    comm_ =
        std::make_unique<NcclComm>(rank, world, device, "parapilot/nccl_id", set, get, timeout_s);
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Status all_reduce_sum(std::vector<at::Tensor>& tensors) override {
    for (auto& t : tensors)
      if (Status st = reduce(t, false); !st.ok()) return st;
    return {};
  }
  Status all_reduce_max(at::Tensor& tensor) override { return reduce(tensor, true); }
  StatusOr<std::vector<at::Tensor>> all_gather(const at::Tensor& input) override {
    // All-gather as a sum all-reduce of a zero-padded [world, n] buffer (small top-k payloads).
    at::Tensor buf = at::zeros({world_, input.numel()}, input.options().dtype(at::kFloat));
    buf[rank_].copy_(input.reshape({-1}).to(at::kFloat));
    if (Status st = reduce(buf, false); !st.ok()) return st;
    std::vector<at::Tensor> out;
    for (int r = 0; r < world_; ++r)
      out.push_back(buf[r].to(input.scalar_type()).view(input.sizes()));
    return out;
  }
  Status broadcast(std::vector<at::Tensor>& tensors) override {
    for (auto& t : tensors) {
      if (rank_ != 0) t.zero_();
      if (Status st = reduce(t, false); !st.ok()) return st;
    }
    return {};
  }
  std::string backend() const override { return "nccl"; }

 private:
  Status reduce(at::Tensor& t, bool max) {
    const bool half = t.scalar_type() == at::kHalf;
    at::Tensor c = half ? t.contiguous() : t.to(at::kFloat).contiguous();
    try {
      comm_->all_reduce(c.data_ptr(), static_cast<std::size_t>(c.numel()), half, max);
    } catch (const std::exception& e) {
      return Status::collective_failed(e.what());
    }
    if (!c.is_same(t)) t.copy_(c);
    return {};
  }
  int rank_, world_;
  std::unique_ptr<NcclComm> comm_;
};
#endif

std::string expand_rank(std::string path, int rank) {
  const std::size_t at = path.find("{rank}");
  if (at != std::string::npos) path.replace(at, 6, std::to_string(rank));
  return path;
}

}  // namespace

namespace {
int run_or_throw(const WorkerOptions& o);
}  // namespace

StatusOr<int> run_worker(const WorkerOptions& o) {
  return catch_input_error([&] { return run_or_throw(o); });
}

namespace {

int run_or_throw(const WorkerOptions& o) {
  check(validate(o));
  at::set_num_threads(o.threads);
  const auto t_start = Clock::now();
  const std::string tag = "worker rank " + std::to_string(o.rank);
  const std::string corpus = load_corpus(o.corpus);
  const std::int64_t seq_bytes = o.model.seq_len + 1;
  if (static_cast<std::int64_t>(corpus.size()) < seq_bytes + 1)
    throw InputError("--corpus: too short for --seq-len " + std::to_string(o.model.seq_len));
  const at::Tensor corpus_t = at::from_blob(const_cast<char*>(corpus.data()),
                                            {static_cast<std::int64_t>(corpus.size())}, at::kByte)
                                  .to(at::kLong);

  // Model: same seed on every rank; rank 0's parameters are broadcast anyway (as DDP does).
  torch::manual_seed(o.seed);
  LanguageModel model(o.model);
  std::vector<at::Tensor> params = model.parameters();
  const std::vector<LayerShape> layers = model_layers(o.model);
  if (layers.size() != params.size())
    throw std::logic_error("model_layers() disagrees with the model's parameter count");
  for (std::size_t i = 0; i < layers.size(); ++i)
    if (params[i].sizes().vec() != layers[i].shape)
      throw std::logic_error("model_layers() disagrees with the model at " + layers[i].name);

  // Rendezvous and collectives.
  std::unique_ptr<Collectives> coll;
  if (o.world_size == 1 && o.backend == "gloo" && std::getenv("MASTER_PORT") == nullptr) {
    coll = make_local_collectives();
  } else {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(o.master_port);
    so.isServer = o.rank == 0;
    so.numWorkers = static_cast<std::size_t>(o.world_size);
    so.waitWorkers = true;
    so.timeout =
        std::chrono::milliseconds(static_cast<std::int64_t>(o.rendezvous_timeout_s * 1000));
    c10::intrusive_ptr<c10d::Store> store;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "%s: rendezvous at %s:%d failed: %s\n", tag.c_str(),
                   o.master_addr.c_str(), o.master_port, e.what_without_backtrace());
      return kWorkerCollectiveFailed;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: rendezvous at %s:%d failed: %s\n", tag.c_str(),
                   o.master_addr.c_str(), o.master_port, e.what());
      return kWorkerCollectiveFailed;
    }
    if (o.backend == "nccl") {
#ifdef PARAPILOT_HAVE_NCCL
      std::string why;
      const int gpus = cuda_device_count(&why);
      if (gpus == 0) throw InputError("--backend nccl: " + why);
      coll = std::make_unique<NcclCollectives>(store, o.rank, o.world_size, o.local_rank % gpus,
                                               o.collective_timeout_s);
#else
      throw InputError("--backend nccl: this build has no NCCL (CMake found no CUDA/NCCL)");
#endif
    } else {
      try {
        coll = std::make_unique<GlooCollectives>(store, o.rank, o.world_size,
                                                 o.collective_timeout_s, o.master_addr);
      } catch (const c10::Error& e) {
        std::fprintf(stderr, "%s: gloo setup failed: %s\n", tag.c_str(),
                     e.what_without_backtrace());
        return kWorkerCollectiveFailed;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: gloo setup failed: %s\n", tag.c_str(), e.what());
        return kWorkerCollectiveFailed;
      }
    }
  }

  std::unique_ptr<WorkerBus> bus;
  if (!o.agent.empty()) {
    auto read_plan = [&o, n_layers = layers.size()](
                         const transport::PlanPrepare& p) -> StatusOr<LiveAction> {
      StatusOr<LiveAction> read = action_from_plan(p, o.world_size, n_layers);
      if (!read.ok()) return read;
      const LiveAction& a = *read;
      if (!a.shares.empty() && a.shares.size() != static_cast<std::size_t>(o.world_size))
        return Status::rejected("shares for " + std::to_string(a.shares.size()) +
                                " ranks; the job has " + std::to_string(o.world_size));
      if (!a.compression.empty() && a.compression.size() != n_layers)
        return Status::rejected("compression for " + std::to_string(a.compression.size()) +
                                " layers; the model has " + std::to_string(n_layers));
      if (a.microbatch > 0 && o.global_batch % a.microbatch != 0)
        return Status::rejected("microbatch " + std::to_string(a.microbatch) +
                                " does not divide the global batch " +
                                std::to_string(o.global_batch));
      return read;
    };
    transport::JobInfo job;
    job.rank = static_cast<std::uint32_t>(o.rank);
    job.world_size = static_cast<std::uint32_t>(o.world_size);
    job.global_batch = static_cast<std::uint32_t>(o.global_batch);
    job.capabilities =
        transport::kCapDpShares | transport::kCapCompression | transport::kCapMicroBatches;
    job.framework = "parapilot-worker";
    for (const at::Tensor& p : params) {
      const auto n = static_cast<std::uint64_t>(p.numel());
      job.layers.push_back({n, n * static_cast<std::uint64_t>(p.element_size())});
    }
    bus = take(WorkerBus::connect(o.agent, o.secret_file, o.rank, read_plan, std::move(job)));
    bus->wait_connected(10000);
  }

  // Current plan.
  std::vector<double> shares =
      o.shares.empty()
          ? std::vector<double>(static_cast<std::size_t>(o.world_size), 1.0 / o.world_size)
          : take(parse_shares(o.shares));
  int microbatch = o.microbatch;
  GradientSync gsync(layers, o.seed);
  {
    std::vector<Compression> comp;
    if (o.compression == "auto") {
      comp = select_compression(layers, {}, SelectorOptions{.powersgd_rank = o.powersgd_rank});
    } else {
      comp = take(parse_compression_list(o.compression));
      if (comp.size() == 1) comp.assign(layers.size(), comp[0]);
    }
    gsync.configure(comp, o.topk_ratio, o.powersgd_rank, o.bucket_bytes);
  }
  double topk_ratio = o.topk_ratio;
  int powersgd_rank = o.powersgd_rank;
  std::int64_t bucket_bytes = o.bucket_bytes;

  std::unique_ptr<torch::optim::Optimizer> opt;
  if (o.optimizer == "adam")
    opt = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr));
  else
    opt = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr));

  std::vector<trace::TelemetrySample> recorded;
  std::ofstream loss_log;
  if (o.rank == 0 && !o.loss_log.empty()) {
    loss_log.open(o.loss_log);
    if (!loss_log) throw InputError("--loss-log '" + o.loss_log + "': cannot write");
    loss_log << "step,loss,tokens,dp_bytes,step_s\n";
    loss_log << std::setprecision(9);
  }

  int exit_code = kWorkerOk;
  std::uint64_t plan_id = 0;
  std::uint64_t step = 0;
  double tokens = 0;
  std::uint64_t total_dp_bytes = 0;
  std::string failure;
  // A collective that failed ends the training loop: the others notice through their own.
  auto collective_ok = [&](const Status& st) {
    if (st.ok()) return true;
    failure = st.message();
    exit_code = kWorkerCollectiveFailed;
    return false;
  };
  try {
    bool started = false;
    {
      torch::NoGradGuard ng;
      started = collective_ok(coll->broadcast(params));
    }
    while (started) {
      const double now_s = seconds_since(t_start);
      // 1. Boundary: agree on stopping and on the plan to switch to (transport/plan_book.h):
      // the newest plan committed on some rank (MAX), then whether every rank holds it.
      // Integers, so that plan ids (microseconds since the epoch) survive exactly.
      at::Tensor control = at::zeros({2}, at::kLong);
      if (bus) control[0] = static_cast<std::int64_t>(bus->committed_at(step, plan_id));
      const bool stop = (o.steps > 0 && static_cast<std::int64_t>(step) >= o.steps) ||
                        (o.max_seconds > 0 && o.rank == 0 && now_s >= o.max_seconds) ||
                        (bus && bus->stop_requested());
      control[1] = stop ? 1 : 0;
      const auto tc = Clock::now();
      if (!collective_ok(coll->all_reduce_max(control))) break;
      if (control[1].item<std::int64_t>() > 0) break;
      const auto next_plan = static_cast<std::uint64_t>(control[0].item<std::int64_t>());
      if (next_plan > plan_id) {
        at::Tensor held = at::full({1}, bus && bus->holds(next_plan) ? 1 : 0, at::kLong);
        std::vector<at::Tensor> ht{held};
        if (!collective_ok(coll->all_reduce_sum(ht))) break;
        const std::optional<LiveAction> a =
            held.item<std::int64_t>() == o.world_size ? bus->applied(next_plan) : std::nullopt;
        if (!a) {
          if (bus)
            bus->missed(next_plan, "rank " + std::to_string(o.rank) + ": plan " +
                                       std::to_string(next_plan) +
                                       " not staged on every rank at the boundary; nobody "
                                       "switched");
        } else {
          if (!a->shares.empty()) shares = a->shares;
          if (a->microbatch > 0) microbatch = a->microbatch;
          if (a->topk_ratio > 0) topk_ratio = a->topk_ratio;
          if (a->powersgd_rank > 0) powersgd_rank = a->powersgd_rank;
          if (a->bucket_bytes >= 0) bucket_bytes = a->bucket_bytes;
          gsync.configure(a->compression.empty() ? gsync.compression() : a->compression,
                          topk_ratio, powersgd_rank, bucket_bytes);
          plan_id = next_plan;
        }
      }
      const double control_ms = seconds_since(tc) * 1000;

      // 2. Forward/backward over this rank's microbatches.
      const std::uint64_t step_start_ns = wall_ns();
      const double step_start_s = seconds_since(t_start);
      const int total_mb = o.global_batch / microbatch;
      const std::vector<int> counts = microbatch_counts(shares, total_mb);
      int first = 0;
      for (int r = 0; r < o.rank; ++r) first += counts[r];
      const int mine = counts[o.rank];
      const bool slowed =
          o.slow_factor > 1 && now_s >= o.slow_at_s && now_s < o.slow_at_s + o.slow_for_s;
      opt->zero_grad();
      for (auto& p : params) {
        if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      }
      double compute_ms = 0;
      double local_loss = 0;
      for (int j = first; j < first + mine; ++j) {
        const auto t0 = Clock::now();
        std::vector<at::Tensor> rows;
        for (int i = 0; i < microbatch; ++i) {
          const std::uint64_t g = static_cast<std::uint64_t>(j * microbatch + i);
          const std::uint64_t h = splitmix64(o.seed * 0x100000001B3ull ^ (step << 24) ^ g);
          const std::int64_t start = static_cast<std::int64_t>(
              h % static_cast<std::uint64_t>(corpus_t.size(0) - seq_bytes));
          rows.push_back(corpus_t.narrow(0, start, seq_bytes));
        }
        at::Tensor batch = at::stack(rows);
        at::Tensor loss = model.loss(batch) / static_cast<double>(total_mb);
        loss.backward();
        local_loss += loss.item<double>();
        double ms = seconds_since(t0) * 1000;
        if (slowed) {
          std::this_thread::sleep_for(
              std::chrono::duration<double, std::milli>((o.slow_factor - 1) * ms));
          ms = seconds_since(t0) * 1000;
        }
        compute_ms += ms;
      }

      // 3. Per-layer gradient statistics (local, before the reduction).
      std::vector<transport::LayerGradStat> layer_stats;
      const bool publish = bus && step % static_cast<std::uint64_t>(o.telemetry_every) == 0;
      std::vector<at::Tensor> grads;
      for (std::size_t i = 0; i < params.size(); ++i) {
        grads.push_back(params[i].mutable_grad());
        if (publish) {
          const at::Tensor g = grads.back();
          const at::Tensor finite = g.isfinite();
          const auto nonfinite =
              static_cast<std::uint32_t>(g.numel() - finite.sum().item<std::int64_t>());
          const at::Tensor gf = nonfinite ? g.where(finite, at::zeros_like(g)) : g;
          layer_stats.push_back({static_cast<std::uint32_t>(i), gf.norm().item<float>(),
                                 gf.abs().max().item<float>(), nonfinite});
        }
      }

      // 4. Gradient reduction.
      const bool delayed = o.link_delay_ms > 0 && now_s >= o.link_delay_at_s &&
                           now_s < o.link_delay_at_s + o.link_delay_for_s;
      auto before_call = [&] {
        if (delayed)
          std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(o.link_delay_ms));
      };
      const StatusOr<SyncStats> synced = gsync.sync(grads, *coll, before_call);
      if (!collective_ok(synced.status())) break;
      const SyncStats& sync = *synced;
      // 5. Global loss (for the log) and the update.
      at::Tensor loss_t = at::full({1}, local_loss, at::kDouble);
      std::vector<at::Tensor> lt{loss_t};
      const auto tl = Clock::now();
      if (!collective_ok(coll->all_reduce_sum(lt))) break;
      const double loss_ms = seconds_since(tl) * 1000;
      opt->step();

      const std::uint64_t step_end_ns = wall_ns();
      const double step_end_s = seconds_since(t_start);
      const double step_tokens = static_cast<double>(o.global_batch) * o.model.seq_len;
      tokens += step_tokens;
      const std::uint64_t dp_bytes = sync.all_reduce_bytes + sync.all_gather_bytes;
      total_dp_bytes += dp_bytes;
      if (loss_log.is_open())
        loss_log << step << ',' << loss_t.item<double>() << ',' << tokens << ',' << total_dp_bytes
                 << ',' << (step_end_s - step_start_s) << '\n';

      trace::TelemetrySample row;
      row.rank = o.rank;
      row.dp_rank = o.rank;
      row.step = static_cast<std::int64_t>(step);
      row.start_s = step_start_s;
      row.end_s = step_end_s;
      row.microbatches = mine;
      row.compute_ms = compute_ms;
      row.dp_comm = {sync.all_reduce_ms + sync.all_gather_ms, static_cast<double>(dp_bytes)};
      if (!o.record.empty()) recorded.push_back(row);

      if (publish) {
        transport::Telemetry t;
        t.rank = static_cast<std::uint32_t>(o.rank);
        t.step = step;
        t.step_start_ns = step_start_ns;
        t.step_end_ns = step_end_ns;
        // Everything this rank did in the step except waiting in its collectives: a slowdown
        // anywhere in the step (batch building, the optimizer) counts, a wait for a peer not.
        const double wall_ms = static_cast<double>(step_end_ns - step_start_ns) / 1e6;
        const double wait_ms = sync.all_reduce_ms + sync.all_gather_ms + loss_ms;
        t.compute_ms = std::clamp(wall_ms - wait_ms, compute_ms, std::max(compute_ms, wall_ms));
        t.queue_depth = sync.buckets;
        t.collectives["wait/dp"] = {sync.all_reduce_ms + sync.all_gather_ms, 0, 1};
        t.collectives["all_reduce/dp"] = {sync.all_reduce_ms, sync.all_reduce_bytes,
                                          sync.all_reduce_calls};
        if (sync.all_gather_calls)
          t.collectives["all_gather/dp"] = {sync.all_gather_ms, sync.all_gather_bytes,
                                            sync.all_gather_calls};
        t.collectives["all_reduce/control"] = {control_ms + loss_ms, 0, 2};
        // Microbatches processed and the global loss, for the agent's throughput and reward.
        t.collectives["info/microbatches"] = {0, static_cast<std::uint64_t>(mine),
                                              static_cast<std::uint32_t>(total_mb)};
        t.collectives["info/loss_x1e6"] = {
            0, static_cast<std::uint64_t>(std::max(0.0, loss_t.item<double>()) * 1e6), 0};
        t.collectives["info/plan"] = {0, plan_id, 0};
        // Samples this rank processed: the monitor compares ranks' compute per sample, so a
        // rank given a smaller share does not look faster than it is.
        t.collectives["info/samples"] = {0, static_cast<std::uint64_t>(mine) * microbatch, 0};
        t.layers = std::move(layer_stats);
        t.send_time_ns = wall_ns();
        bus->send(t);
      }
      ++step;
    }
  } catch (const c10::Error& e) {
    failure = e.what_without_backtrace();
    exit_code = kWorkerCollectiveFailed;
  } catch (const std::exception& e) {
    failure = e.what();
    exit_code = 1;
  }
  if (exit_code != kWorkerOk)
    std::fprintf(stderr, "%s: stopping at step %llu: %s\n", tag.c_str(),
                 static_cast<unsigned long long>(step), failure.c_str());

  if (!o.record.empty()) {
    std::ofstream out(expand_rank(o.record, o.rank));
    if (!out) throw InputError("--record '" + o.record + "': cannot write");
    trace::write_telemetry(recorded, out);
  }
  if (o.rank == 0 && !o.dump_params.empty() && exit_code == kWorkerOk) {
    std::ofstream out(o.dump_params, std::ios::binary);
    for (const auto& p : params) {
      const at::Tensor c = p.detach().to(at::kFloat).contiguous();
      out.write(static_cast<const char*>(c.data_ptr()),
                static_cast<std::streamsize>(c.numel() * 4));
    }
  }
  if (bus) {
    transport::Shutdown bye;
    bye.reason = exit_code == kWorkerOk ? "rank " + std::to_string(o.rank) + " finished at step " +
                                              std::to_string(step)
                                        : ("rank " + std::to_string(o.rank) + " failed at step " +
                                           std::to_string(step) + ": " + failure)
                                              .substr(0, transport::kMaxTextBytes);
    bus->send(bye);
    bus->flush(2000);
  }
  std::fflush(stdout);
  // After a failed collective the process group may still wait on a dead peer in its
  // destructor; leave it to the process exit instead.
  if (exit_code != kWorkerOk) (void)coll.release();
  return exit_code;
}

}  // namespace

}  // namespace parapilot::live
