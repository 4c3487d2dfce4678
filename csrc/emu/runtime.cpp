#include "emu/runtime.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <tuple>

#include "emu/fiber.h"

namespace flash_ext::emu {

// ---------------------------------------------------------------------------------------------------
// Report

void Stats::merge(Stats const& o) {
  ctas += o.ctas, threads += o.threads, barriers += o.barriers;
  ldmatrix += o.ldmatrix, mma += o.mma, shfl += o.shfl, cp_async += o.cp_async, smem_vector += o.smem_vector;
  vote += o.vote, vote_true += o.vote_true;
  smem_clear += o.smem_clear, global_vector += o.global_vector, red_global += o.red_global;
  global_plain += o.global_plain;
  wavefronts += o.wavefronts, extra_wavefronts += o.extra_wavefronts, fiber_switches += o.fiber_switches;
}

void Report::add(Check check, uint64_t cta_order, std::string message) {
  ++counts[int(check)];
  messages.emplace_back(cta_order, std::move(message));
  // Keep the first kMaxMessages by (CTA order, arrival): stable sort, then truncate.
  if (messages.size() > 2 * kMaxMessages) {
    std::stable_sort(messages.begin(), messages.end(), [](auto const& a, auto const& b) { return a.first < b.first; });
    messages.resize(kMaxMessages);
  }
}

bool Report::wants_message(uint64_t cta_order) const {
  // Kept are the first kMaxMessages by CTA order (then arrival): a new one makes it unless that many are
  // already at or before its CTA.  Messages are few, so the scan costs less than formatting one.
  size_t at_or_before = 0;
  for (auto const& m : messages) { at_or_before += m.first <= cta_order; }
  return at_or_before < kMaxMessages;
}

void Report::merge(Report const& o) {
  for (int i = 0; i < kNumChecks; ++i) { counts[i] += o.counts[i]; }
  stats.merge(o.stats);
  for (auto const& k : o.kernels) {
    if (std::find(kernels.begin(), kernels.end(), k) == kernels.end()) { kernels.push_back(k); }
  }
  messages.insert(messages.end(), o.messages.begin(), o.messages.end());
  std::stable_sort(messages.begin(), messages.end(), [](auto const& a, auto const& b) { return a.first < b.first; });
  if (messages.size() > kMaxMessages) { messages.resize(kMaxMessages); }
}

uint64_t Report::total() const {
  uint64_t n = 0;
  for (uint64_t c : counts) { n += c; }
  return n;
}

namespace {

std::string json_string(std::string const& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

}  // namespace

std::string Report::json() const {
  std::ostringstream os;
  os << "{\"findings\": " << total() << ", \"counts\": {";
  for (int i = 0; i < kNumChecks; ++i) { os << (i ? ", " : "") << "\"" << kCheckNames[i] << "\": " << counts[i]; }
  Stats const& s = stats;
  os << "}, \"stats\": {\"ctas\": " << s.ctas << ", \"threads\": " << s.threads << ", \"barriers\": " << s.barriers
     << ", \"ldmatrix\": " << s.ldmatrix << ", \"mma\": " << s.mma << ", \"shfl\": " << s.shfl
     << ", \"vote\": " << s.vote << ", \"vote_true\": " << s.vote_true
     << ", \"cp_async\": " << s.cp_async << ", \"smem_vector\": " << s.smem_vector << ", \"smem_clear\": "
     << s.smem_clear << ", \"global_vector\": " << s.global_vector << ", \"red_global\": " << s.red_global
     << ", \"global_plain\": " << s.global_plain
     << ", \"wavefronts\": " << s.wavefronts << ", \"extra_wavefronts\": " << s.extra_wavefronts
     << ", \"fiber_switches\": " << s.fiber_switches << "}, \"kernels\": [";
  for (size_t i = 0; i < kernels.size(); ++i) { os << (i ? ", " : "") << json_string(kernels[i]); }
  os << "], \"messages\": [";
  std::vector<std::pair<uint64_t, std::string>> sorted = messages;
  std::stable_sort(sorted.begin(), sorted.end(), [](auto const& a, auto const& b) { return a.first < b.first; });
  for (size_t i = 0; i < sorted.size() && i < kMaxMessages; ++i) { os << (i ? ", " : "") << json_string(sorted[i].second); }
  os << "]}";
  return os.str();
}

std::string Report::text() const {
  std::ostringstream os;
  os << total() << " finding" << (total() == 1 ? "" : "s") << " (";
  bool first = true;
  for (int i = 0; i < kNumChecks; ++i) {
    if (counts[i]) {
      os << (first ? "" : ", ") << kCheckNames[i] << " " << counts[i];
      first = false;
    }
  }
  os << ")";
  if (stats.extra_wavefronts) { os << ", " << stats.extra_wavefronts << " extra shared-memory wavefronts"; }
  std::vector<std::pair<uint64_t, std::string>> sorted = messages;
  std::stable_sort(sorted.begin(), sorted.end(), [](auto const& a, auto const& b) { return a.first < b.first; });
  for (size_t i = 0; i < sorted.size() && i < kMaxMessages; ++i) { os << "\n  - " << sorted[i].second; }
  if (total() > kMaxMessages) { os << "\n  (first " << kMaxMessages << " shown)"; }
  return os.str();
}

// ---------------------------------------------------------------------------------------------------
// The CTA scheduler.

namespace {

constexpr int kWarp = ptx::kWarp;
// Kernel frames (CuTe register tensors, the accumulators) take a few KB; the rest is margin.  Pages are
// committed only when touched.
constexpr size_t kStackBytes = 256 * 1024;

enum class State : uint8_t { kRunnable, kAtEvent, kAtCollective, kAtBarrier, kExited };
enum class Op : uint8_t { kNone, kLdsm, kLdsmT, kLdsmX2, kMma, kShfl, kVote, kCpAsync, kVecLoad, kVecStore, kClear };

char const* op_name(Op op) {
  switch (op) {
    case Op::kLdsm: return "ldmatrix.sync.aligned.m8n8.x4.shared.b16";
    case Op::kLdsmT: return "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16";
    case Op::kLdsmX2: return "ldmatrix.sync.aligned.m8n8.x2.shared.b16";
    case Op::kMma: return "mma.sync.aligned.m16n8k16";
    case Op::kShfl: return "shfl.sync.bfly.b32";
    case Op::kVote: return "vote.sync.any.pred";
    case Op::kCpAsync: return "cp.async.cg.shared.global [16 B]";
    case Op::kVecLoad: return "ld.shared (vector move)";
    case Op::kVecStore: return "st.shared (vector move)";
    case Op::kClear: return "st.shared (zero-fill)";
    default: return "?";
  }
}

enum : uint8_t { kNever = 0, kInFlight = 1, kValid = 2 };

// Shadow state of one shared-memory byte.  Epochs count CTA barriers (the first epoch is 1).
struct ByteState {
  uint32_t w_epoch, r_epoch;
  uint16_t writer, reader;  // thread ids of the last write and of a read in r_epoch
  uint8_t state;            // kNever / kInFlight / kValid
  uint8_t multi;            // more than one thread read it in r_epoch
};

struct Copy {
  void const* src;
  uint32_t off, bytes;
};

class Cta;

struct Thread {
  Cta* cta = nullptr;
  int tid = 0;
  State state = State::kExited;
  Context ctx;
  std::unique_ptr<FiberStack> stack;
  // The posted event.
  Op op = Op::kNone;
  void const* src = nullptr;
  void* dst = nullptr;
  int bytes = 0;
  uint32_t* ld[4] = {};
  ptx::MmaLane mma{};
  ptx::Type16 mma_type = ptx::Type16::kF16;
  float* mma_d[4] = {};
  float shfl_value = 0.f, shfl_result = 0.f;
  int shfl_mask = 0;
  bool vote_value = false, vote_result = false;
  // cp.async: issued but not committed, and committed groups (oldest first).
  std::vector<Copy> open;
  std::vector<std::vector<Copy>> groups;
  // The latest policy call, for messages.
  char const* site_what = "kernel start";
  Site site{};
};

thread_local Thread* tl_self = nullptr;

Thread& self() {
  if (tl_self == nullptr) {
    std::fprintf(stderr, "flash_ext emulator: an emulated instruction ran outside an emulated CTA\n");
    std::abort();
  }
  return *tl_self;
}

std::string base_name(char const* path) {
  std::string s = path ? path : "?";
  size_t const slash = s.find_last_of('/');
  return slash == std::string::npos ? s : s.substr(slash + 1);
}

class Cta {
 public:
  void run(KernelDesc const& k, CtaCoord const& coord, CtaBody body, void const* ctx, Report& report);

  // Instructions (called on the emulated thread).
  void park(Thread& t, State s);
  void ldmatrix(Thread& t, int num, bool trans, void const* row, uint32_t* d[4]);
  void mma(Thread& t, ptx::Type16 type, ptx::MmaLane const& in, float* d[4]);
  float shfl(Thread& t, float value, int mask);
  bool vote_any(Thread& t, bool value);
  void cp_async(Thread& t, void const* src, void* dst);
  void commit(Thread& t);
  void wait(Thread& t, int pending);
  void barrier(Thread& t);
  void vector_move(Thread& t, void const* src, void* dst, int bytes);
  void clear_store(Thread& t, void* dst, int bytes);
  void clear_done(Thread& t);
  void red_add(Thread& t, float* dst, float v);
  void plain_global(Thread& t, void const* src, void* dst, int bytes, bool store);
  [[noreturn]] void exit_thread(Thread& t);

 private:
  static void entry(void* arg);
  void ensure_capacity(int threads, int smem_bytes);
  void schedule();
  bool step_warp(int w);
  void execute_events(Thread* const* lanes);
  void execute_collective(Thread* const* lanes, Op op);
  void release_barrier();
  void report_stall();
  void resume(Thread& t);

  // Shared memory and its shadow.
  bool shared_offset(void const* p, int bytes, uint32_t& off) const;
  bool in_shared(void const* p) const;
  void shared_read(Thread& t, uint32_t off, uint32_t n, Op op);
  void shared_write(Thread& t, uint32_t off, uint32_t n, Op op, bool in_flight);
  void land(Thread& t, Copy const& c);
  bool global_ok(Thread& t, void const* p, int bytes, bool write, Op op, char const* what);
  void bank_model(Thread* const* lanes, uint32_t lane_mask, uint32_t const* offsets, int bytes, Op op, int warp);

  // Messages.
  std::string where(Thread const& t, Op op) const;
  std::string byte_name(uint32_t off) const;
  static std::string who(int tid);
  // Counts a finding; builds its message (text() returns it) only if the report will keep it.
  template <class Text>
  void finding(Check c, Text&& text) {
    if (report_->wants_message(coord_->order)) {
      report_->add(c, coord_->order, text());
    } else {
      report_->count(c);
    }
  }

  std::vector<std::unique_ptr<Thread>> threads_;
  std::vector<char> smem_storage_;
  char* smem_ = nullptr;
  std::vector<ByteState> shadow_;
  Context scheduler_;
  KernelDesc const* kernel_ = nullptr;
  CtaCoord const* coord_ = nullptr;
  CtaBody body_ = nullptr;
  void const* body_ctx_ = nullptr;
  Report* report_ = nullptr;
  int nthreads_ = 0, smem_bytes_ = 0;
  int live_ = 0, at_barrier_ = 0;
  uint32_t epoch_ = 1;
  bool aborted_ = false;
  size_t dirty_ = 0;  // shared bytes [0, dirty_) were touched by the current CTA
};

thread_local std::unique_ptr<Cta> tl_cta;

void Cta::ensure_capacity(int threads, int smem_bytes) {
  while (int(threads_.size()) < threads) {
    auto t = std::make_unique<Thread>();
    t->cta = this;
    t->tid = int(threads_.size());
    t->stack = std::make_unique<FiberStack>(kStackBytes);
    threads_.push_back(std::move(t));
  }
  if (int(shadow_.size()) < smem_bytes) {
    smem_storage_.assign(size_t(smem_bytes) + 128, 0);
    auto const p = reinterpret_cast<uintptr_t>(smem_storage_.data());
    smem_ = reinterpret_cast<char*>((p + 127) & ~uintptr_t(127));  // __align__(128) like the CUDA kernel's
    std::memset(smem_, 0xff, size_t(smem_bytes));
    shadow_.assign(size_t(smem_bytes), ByteState{});
    dirty_ = 0;
  }
}

void Cta::entry(void* arg) {
  Thread& t = *static_cast<Thread*>(arg);
  Cta& c = *t.cta;
  c.body_(c.body_ctx_, t.tid, c.smem_);
  c.exit_thread(t);
}

void Cta::run(KernelDesc const& k, CtaCoord const& coord, CtaBody body, void const* ctx, Report& report) {
  if (k.threads <= 0 || k.threads % kWarp != 0) {
    std::fprintf(stderr, "flash_ext emulator: %d threads per CTA is not a whole number of warps\n", k.threads);
    std::abort();
  }
  ensure_capacity(k.threads, k.smem_bytes);
  kernel_ = &k, coord_ = &coord, body_ = body, body_ctx_ = ctx, report_ = &report;
  nthreads_ = k.threads, smem_bytes_ = k.smem_bytes;
  // Reset what the previous CTA touched (a CTA that exits at once touches nothing).  Shared memory is
  // refilled with 0xff (NaN in fp16/bf16) so stale values cannot pass for data.
  std::fill(shadow_.begin(), shadow_.begin() + dirty_, ByteState{});
  std::memset(smem_, 0xff, dirty_);
  dirty_ = 0;
  epoch_ = 1, live_ = nthreads_, at_barrier_ = 0, aborted_ = false;
  for (int i = 0; i < nthreads_; ++i) {
    Thread& t = *threads_[i];
    t.state = State::kRunnable;
    t.op = Op::kNone;
    t.open.clear();
    t.groups.clear();
    t.site_what = "kernel start";
    t.site = Site{};
    t.ctx.prepare(*t.stack, &Cta::entry, &t);
  }
  ++report.stats.ctas;
  report.stats.threads += uint64_t(nthreads_);
  if (std::find(report.kernels.begin(), report.kernels.end(), k.name) == report.kernels.end()) {
    report.kernels.push_back(k.name);
  }
  schedule();
}

void Cta::resume(Thread& t) {
  tl_self = &t;
  Context::switch_to(scheduler_, t.ctx);
  tl_self = nullptr;
  report_->stats.fiber_switches += 2;
}

void Cta::park(Thread& t, State s) {
  t.state = s;
  Context::switch_to(t.ctx, scheduler_);
}

void Cta::exit_thread(Thread& t) {
  size_t in_flight = t.open.size();
  for (auto const& g : t.groups) { in_flight += g.size(); }
  if (in_flight) {
    finding(Check::kInFlightAtExit, [&] { return std::string("copy_in_flight_at_exit: " + who(t.tid) + " exits with " + std::to_string(in_flight) +
                                        " cp.async copies it never waited for; " + where(t, Op::kNone)); });
  }
  --live_;
  t.state = State::kExited;
  Context::switch_to(t.ctx, scheduler_);
  std::abort();  // an exited fiber is never resumed
}

void Cta::schedule() {
  int const warps = nthreads_ / kWarp;
  while (live_ > 0 && !aborted_) {
    bool progress = false;
    for (int w = 0; w < warps && !aborted_; ++w) { progress |= step_warp(w); }
    if (aborted_ || live_ == 0) { break; }
    if (at_barrier_ == live_) {
      release_barrier();
      continue;
    }
    if (!progress) {
      report_stall();
      break;
    }
  }
}

bool Cta::step_warp(int w) {
  Thread* lanes[kWarp];
  for (int l = 0; l < kWarp; ++l) { lanes[l] = threads_[w * kWarp + l].get(); }
  bool progress = false;
  for (int l = 0; l < kWarp; ++l) {
    if (lanes[l]->state == State::kRunnable) {
      resume(*lanes[l]);
      progress = true;
    }
  }
  bool events = false;
  for (int l = 0; l < kWarp; ++l) { events |= lanes[l]->state == State::kAtEvent; }
  if (events) {
    execute_events(lanes);
    progress = true;
  }
  int live = 0, at_collective = 0;
  for (int l = 0; l < kWarp; ++l) {
    live += lanes[l]->state != State::kExited;
    at_collective += lanes[l]->state == State::kAtCollective;
  }
  if (at_collective > 0 && at_collective == live) {
    // Every live lane waits at a collective: it runs if they all wait at the same one and none has exited;
    // otherwise no lane can ever proceed (report_stall describes it).
    Op const op = lanes[0]->op;
    bool same = live == kWarp;
    for (int l = 0; l < kWarp && same; ++l) {
      same = lanes[l]->op == op && (op != Op::kMma || lanes[l]->mma_type == lanes[0]->mma_type);
    }
    if (same) {
      execute_collective(lanes, op);
      for (int l = 0; l < kWarp; ++l) { lanes[l]->state = State::kRunnable; }
      progress = true;
    }
  }
  return progress;
}

void Cta::release_barrier() {
  if (live_ < nthreads_) {
    std::string exited;
    int n = 0;
    for (int i = 0; i < nthreads_; ++i) {
      if (threads_[i]->state == State::kExited) {
        if (n++ < 4) { exited += (exited.empty() ? "" : ", ") + std::to_string(i); }
      }
    }
    Thread const& waiter = *std::find_if(threads_.begin(), threads_.begin() + nthreads_,
                                         [](auto const& t) { return t->state == State::kAtBarrier; })->get();
    finding(Check::kExitAtBarrier, [&] { return std::string("exit_at_barrier: " + std::to_string(live_) + " threads wait at a barrier that " +
                                       std::to_string(n) + " exited threads (" + exited + (n > 4 ? ", ..." : "") +
                                       ") never reach; " + where(waiter, Op::kNone)); });
  }
  ++epoch_;
  ++report_->stats.barriers;
  at_barrier_ = 0;
  for (int i = 0; i < nthreads_; ++i) {
    if (threads_[i]->state == State::kAtBarrier) { threads_[i]->state = State::kRunnable; }
  }
}

void Cta::report_stall() {
  // Nothing can proceed and not every live thread is at the barrier: some warp's lanes wait at different
  // collectives, at a collective that exited lanes never join, or partly at the barrier.
  std::string detail;
  for (int w = 0; w < nthreads_ / kWarp && detail.empty(); ++w) {
    auto what = [&](int l) -> std::string {
      Thread const& t = *threads_[w * kWarp + l];
      return t.state == State::kExited ? "exited" : t.state == State::kAtBarrier ? "barrier" : op_name(t.op);
    };
    bool stuck = false;
    for (int l = 0; l < kWarp; ++l) { stuck |= threads_[w * kWarp + l]->state == State::kAtCollective; }
    if (!stuck) { continue; }
    std::string lanes;  // runs of lanes in the same state: "0-15: mma..., 16-31: barrier"
    for (int l = 0; l < kWarp;) {
      int e = l;
      while (e + 1 < kWarp && what(e + 1) == what(l)) { ++e; }
      lanes += (lanes.empty() ? "" : ", ") + std::to_string(l) + (e > l ? "-" + std::to_string(e) : "") + ": " + what(l);
      l = e + 1;
    }
    detail = "the lanes of warp " + std::to_string(w) + " wait at different places (" + lanes + "); " +
             where(*threads_[w * kWarp], Op::kNone);
  }
  if (detail.empty()) { detail = "no thread can proceed; " + where(*threads_[0], Op::kNone); }
  finding(Check::kDivergence, [&] { return std::string("divergence: " + detail + " (CTA abandoned)"); });
  aborted_ = true;
}

// ---------------------------------------------------------------------------------------------------
// Messages

std::string Cta::who(int tid) {
  return "thread " + std::to_string(tid) + " (warp " + std::to_string(tid / kWarp) + ", lane " +
         std::to_string(tid % kWarp) + ")";
}

std::string Cta::byte_name(uint32_t off) const {
  char const* name = "smem";
  uint32_t base = 0;
  for (SmemRegion const& r : kernel_->regions) {
    if (r.begin <= off) { name = r.name, base = r.begin; }
  }
  return "shared byte " + std::to_string(off) + " (" + name + " + " + std::to_string(off - base) + ")";
}

std::string Cta::where(Thread const& t, Op op) const {
  std::ostringstream os;
  if (op != Op::kNone) { os << op_name(op) << ", "; }
  os << "after " << base_name(t.site.file_name()) << ":" << t.site.line() << " (" << t.site_what << "); barrier epoch "
     << epoch_ << "; CTA block (" << coord_->x << ", " << coord_->y << ", " << coord_->z << ") = " << coord_->work
     << "; " << kernel_->name;
  return os.str();
}


// ---------------------------------------------------------------------------------------------------
// Shared memory

bool Cta::in_shared(void const* p) const {
  auto const a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(smem_);
  return a >= b && a < b + uintptr_t(smem_bytes_);
}

bool Cta::shared_offset(void const* p, int bytes, uint32_t& off) const {
  auto const a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(smem_);
  if (a < b || a + uintptr_t(bytes) > b + uintptr_t(smem_bytes_)) { return false; }
  off = uint32_t(a - b);
  return true;
}

void Cta::shared_read(Thread& t, uint32_t off, uint32_t n, Op op) {
  dirty_ = std::max(dirty_, size_t(off + n));
  bool raced = false, unlanded = false;
  for (uint32_t i = off; i < off + n; ++i) {
    ByteState& s = shadow_[i];
    if (!unlanded && s.state != kValid) {
      unlanded = true;
      finding(Check::kUnlandedRead, [&] { return std::string("unlanded_read: " + who(t.tid) + " reads " + byte_name(i) +
                  (s.state == kNever ? std::string(", which no copy or store has written in this CTA")
                                     : ", whose cp.async by " + who(s.writer) + " is still in flight (no cp.async wait)") +
                  "; " + where(t, op)); });
    } else if (!raced && s.state == kValid && s.w_epoch == epoch_ && s.writer != t.tid) {
      raced = true;
      finding(Check::kRace, [&] { return std::string("race: " + who(t.tid) + " reads " + byte_name(i) + " that " + who(s.writer) +
                                " wrote in the same barrier epoch (read after write without a barrier); " +
                                where(t, op)); });
    }
    if (s.r_epoch != epoch_) {
      s.r_epoch = epoch_, s.reader = uint16_t(t.tid), s.multi = 0;
    } else if (s.reader != t.tid) {
      s.multi = 1;
    }
  }
}

void Cta::shared_write(Thread& t, uint32_t off, uint32_t n, Op op, bool in_flight) {
  dirty_ = std::max(dirty_, size_t(off + n));
  bool raced = false;
  for (uint32_t i = off; i < off + n; ++i) {
    ByteState& s = shadow_[i];
    if (!raced) {
      std::string what;
      if (s.state == kInFlight) {
        what = "that a cp.async of " + who(s.writer) + " is still copying into (write after write)";
      } else if (s.state == kValid && s.w_epoch == epoch_ && s.writer != t.tid) {
        what = "that " + who(s.writer) + " wrote in the same barrier epoch (write after write)";
      } else if (s.r_epoch == epoch_ && (s.multi || s.reader != t.tid)) {
        what = "that " + (s.reader != t.tid ? who(s.reader) : std::string("other threads")) +
               " read in the same barrier epoch (write after read)";
      }
      if (!what.empty()) {
        raced = true;
        finding(Check::kRace, [&] { return std::string("race: " + who(t.tid) + " writes " + byte_name(i) + " " + what + "; " + where(t, op)); });
      }
    }
    s.state = in_flight ? kInFlight : kValid;
    s.writer = uint16_t(t.tid);
    s.w_epoch = epoch_;
  }
}

void Cta::land(Thread& t, Copy const& c) {
  dirty_ = std::max(dirty_, size_t(c.off + c.bytes));
  for (uint32_t i = c.off; i < c.off + c.bytes; ++i) {
    ByteState& s = shadow_[i];
    // Data lands now: a read by another thread before this point was an unlanded read, one after it and
    // before the next barrier is a race.
    s.state = kValid, s.writer = uint16_t(t.tid), s.w_epoch = epoch_;
  }
  std::memcpy(smem_ + c.off, c.src, c.bytes);
}

bool Cta::global_ok(Thread& t, void const* p, int bytes, bool write, Op op, char const* what) {
  auto const a = reinterpret_cast<uintptr_t>(p);
  for (GlobalRange const& r : kernel_->globals) {
    if (a >= r.begin && a + uintptr_t(bytes) <= r.end) {
      if (write && !r.writable) {
        finding(Check::kBadAddress, [&] { return std::string(std::string("bad_address: ") + who(t.tid) + " writes " + std::to_string(bytes) +
                                        " bytes into read-only " + r.name + " (" + what + "); " + where(t, op)); });
        return false;
      }
      return true;
    }
  }
  std::ostringstream os;
  os << "bad_address: " << who(t.tid) << " " << (write ? "writes" : "reads") << " " << bytes << " bytes at global "
     << p << " (" << what << "), outside every tensor of the launch";
  for (GlobalRange const& r : kernel_->globals) {
    if (a + uintptr_t(bytes) > r.begin && a < r.end + 4096) {
      os << " (" << r.name << " spans [" << reinterpret_cast<void*>(r.begin) << ", " << reinterpret_cast<void*>(r.end)
         << "))";
    }
  }
  finding(Check::kBadAddress, [&] { return std::string(os.str() + "; " + where(t, op)); });
  return false;
}

// Wavefronts of one warp instruction's shared accesses: lanes in lane_mask at offsets[lane], `bytes` each.
// The warp's requests are served in phases of 128 bytes' worth of lanes (16-byte accesses: 8 lanes, 8-byte:
// 16, up to 4 bytes: all 32; an ldmatrix.x4 phase is one 8x8 matrix = 8 lanes); within a phase, each of the
// 32 four-byte banks delivers one distinct word per wavefront (lanes reading the same word share it).
void Cta::bank_model(Thread* const* lanes, uint32_t lane_mask, uint32_t const* offsets, int bytes, Op op, int warp) {
  int const per_phase = bytes >= 16 ? 8 : bytes == 8 ? 16 : 32;
  for (int p = 0; p < kWarp / per_phase; ++p) {
    uint32_t words[kWarp * 4];
    int nwords = 0;
    for (int l = p * per_phase; l < (p + 1) * per_phase; ++l) {
      if (!((lane_mask >> l) & 1u)) { continue; }
      for (uint32_t w = offsets[l] / 4; w <= (offsets[l] + uint32_t(bytes) - 1) / 4; ++w) { words[nwords++] = w; }
    }
    if (nwords == 0) { continue; }
    std::sort(words, words + nwords);
    nwords = int(std::unique(words, words + nwords) - words);
    int per_bank[32] = {};
    int wavefronts = 0;
    for (int i = 0; i < nwords; ++i) { wavefronts = std::max(wavefronts, ++per_bank[words[i] % 32]); }
    int const ideal = (nwords + 31) / 32;
    report_->stats.wavefronts += uint64_t(wavefronts);
    if (wavefronts > ideal) {
      report_->stats.extra_wavefronts += uint64_t(wavefronts - ideal);
      int worst = 0;
      for (int b = 1; b < 32; ++b) { worst = per_bank[b] > per_bank[worst] ? b : worst; }
      std::string offs;
      for (int l = p * per_phase; l < (p + 1) * per_phase; ++l) {
        if ((lane_mask >> l) & 1u) { offs += (offs.empty() ? "" : ", ") + std::to_string(offsets[l]); }
      }
      Thread const& t0 = *lanes[p * per_phase];
      finding(Check::kBankConflict, [&] { return std::string("bank_conflict: warp " + std::to_string(warp) + " lanes " + std::to_string(p * per_phase) + "-" +
                  std::to_string((p + 1) * per_phase - 1) + " need " + std::to_string(wavefronts) + " wavefronts (" +
                  std::to_string(ideal) + " without conflicts; bank " + std::to_string(worst) + " serves " +
                  std::to_string(per_bank[worst]) + " words) at shared bytes [" + offs + "]; " + where(t0, op)); });
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Per-thread shared-memory instructions, executed a warp at a time.

void Cta::execute_events(Thread* const* lanes) {
  int const warp = lanes[0]->tid / kWarp;
  for (Op op : {Op::kCpAsync, Op::kVecStore, Op::kVecLoad, Op::kClear}) {
    uint32_t mask = 0, valid = 0;
    uint32_t offsets[kWarp] = {};
    for (int l = 0; l < kWarp; ++l) {
      if (lanes[l]->state == State::kAtEvent && lanes[l]->op == op) { mask |= 1u << l; }
    }
    if (!mask) { continue; }
    for (int l = 0; l < kWarp; ++l) {
      if (!((mask >> l) & 1u)) { continue; }
      Thread& t = *lanes[l];
      t.state = State::kRunnable;
      if (op == Op::kClear) { continue; }  // the stores ran on the thread; this step only keeps lockstep
      void const* shared = op == Op::kVecLoad ? t.src : t.dst;
      uint32_t off = 0;
      if (!shared_offset(shared, t.bytes, off) || off % uint32_t(t.bytes) != 0) {
        finding(Check::kBadAddress, [&] { return std::string(std::string("bad_address: ") + who(t.tid) + " accesses " + std::to_string(t.bytes) +
                                        " shared bytes at offset " +
                                        std::to_string(reinterpret_cast<intptr_t>(shared) - reinterpret_cast<intptr_t>(smem_)) +
                                        (in_shared(shared) ? " (misaligned or past the end)" : " (outside shared memory)") +
                                        " of " + std::to_string(smem_bytes_) + "; " + where(t, op)); });
        continue;
      }
      if (op == Op::kCpAsync) {
        if (reinterpret_cast<uintptr_t>(t.src) % 16 != 0) {
          finding(Check::kBadAddress, [&] { return std::string("bad_address: " + who(t.tid) + " cp.async from a global address not 16-byte aligned; " +
                                          where(t, op)); });
          continue;
        }
        if (!global_ok(t, t.src, 16, false, op, "cp.async source")) { continue; }
        shared_write(t, off, 16, op, /*in_flight=*/true);
        std::memset(smem_ + off, 0xff, 16);  // poisoned until the data lands at the wait
        t.open.push_back(Copy{t.src, off, 16});
        ++report_->stats.cp_async;
      } else if (op == Op::kVecStore) {
        shared_write(t, off, uint32_t(t.bytes), op, false);
        std::memcpy(smem_ + off, t.src, size_t(t.bytes));
        ++report_->stats.smem_vector;
      } else {
        shared_read(t, off, uint32_t(t.bytes), op);
        std::memcpy(t.dst, smem_ + off, size_t(t.bytes));
        ++report_->stats.smem_vector;
      }
      valid |= 1u << l;
      offsets[l] = off;
    }
    if (valid && op != Op::kClear) {
      int bytes = 0;
      for (int l = 0; l < kWarp; ++l) {
        if ((valid >> l) & 1u) { bytes = std::max(bytes, lanes[l]->bytes); }
      }
      bank_model(lanes, valid, offsets, bytes, op, warp);
    }
  }
}

void Cta::execute_collective(Thread* const* lanes, Op op) {
  if (op == Op::kLdsm || op == Op::kLdsmT || op == Op::kLdsmX2) {
    // .x2 reads the rows of lanes 0-15 only: the other lanes' addresses are neither used nor checked.
    int const num = op == Op::kLdsmX2 ? 2 : 4;
    uint16_t rows[kWarp][8] = {};
    uint32_t offsets[kWarp] = {}, valid = 0;
    for (int l = 0; l < 8 * num; ++l) {
      Thread& t = *lanes[l];
      uint32_t off = 0;
      if (!shared_offset(t.src, 16, off) || off % 16 != 0) {
        finding(Check::kBadAddress, [&] { return std::string("bad_address: " + who(t.tid) + " gives ldmatrix the row address " +
                                        std::to_string(reinterpret_cast<intptr_t>(t.src) - reinterpret_cast<intptr_t>(smem_)) +
                                        " (bytes from the shared base), which must be 16-byte aligned inside the " +
                                        std::to_string(smem_bytes_) + " shared bytes; " + where(t, op)); });
        std::memset(rows[l], 0xff, sizeof(rows[l]));
        continue;
      }
      shared_read(t, off, 16, op);
      std::memcpy(rows[l], smem_ + off, 16);
      offsets[l] = off;
      valid |= 1u << l;
    }
    bank_model(lanes, valid, offsets, 16, op, lanes[0]->tid / kWarp);
    uint32_t d[kWarp][4];
    ptx::ldmatrix(num, op == Op::kLdsmT, rows, d);
    for (int l = 0; l < kWarp; ++l) {
      for (int i = 0; i < num; ++i) { *lanes[l]->ld[i] = d[l][i]; }
    }
    ++report_->stats.ldmatrix;
  } else if (op == Op::kMma) {
    ptx::MmaLane in[kWarp];
    for (int l = 0; l < kWarp; ++l) { in[l] = lanes[l]->mma; }
    float d[kWarp][4];
    ptx::mma_m16n8k16(lanes[0]->mma_type, in, d);
    for (int l = 0; l < kWarp; ++l) {
      for (int i = 0; i < 4; ++i) { *lanes[l]->mma_d[i] = d[l][i]; }
    }
    ++report_->stats.mma;
  } else if (op == Op::kShfl) {
    float a[kWarp], d[kWarp];
    int mask[kWarp];
    for (int l = 0; l < kWarp; ++l) { a[l] = lanes[l]->shfl_value, mask[l] = lanes[l]->shfl_mask; }
    ptx::shfl_bfly(a, mask, d);
    for (int l = 0; l < kWarp; ++l) { lanes[l]->shfl_result = d[l]; }
    ++report_->stats.shfl;
  } else if (op == Op::kVote) {
    bool any = false;
    for (int l = 0; l < kWarp; ++l) { any |= lanes[l]->vote_value; }
    for (int l = 0; l < kWarp; ++l) { lanes[l]->vote_result = any; }
    ++report_->stats.vote;
    report_->stats.vote_true += any;
  }
}

// ---------------------------------------------------------------------------------------------------
// Instructions on the emulated thread

void Cta::ldmatrix(Thread& t, int num, bool trans, void const* row, uint32_t* d[4]) {
  t.op = num == 2 ? Op::kLdsmX2 : trans ? Op::kLdsmT : Op::kLdsm;
  t.src = row;
  for (int i = 0; i < num; ++i) { t.ld[i] = d[i]; }
  park(t, State::kAtCollective);
}

void Cta::mma(Thread& t, ptx::Type16 type, ptx::MmaLane const& in, float* d[4]) {
  t.op = Op::kMma;
  t.mma = in;
  t.mma_type = type;
  for (int i = 0; i < 4; ++i) { t.mma_d[i] = d[i]; }
  park(t, State::kAtCollective);
}

float Cta::shfl(Thread& t, float value, int mask) {
  t.op = Op::kShfl;
  t.shfl_value = value, t.shfl_mask = mask;
  park(t, State::kAtCollective);
  return t.shfl_result;
}

bool Cta::vote_any(Thread& t, bool value) {
  t.op = Op::kVote;
  t.vote_value = value;
  park(t, State::kAtCollective);
  return t.vote_result;
}

void Cta::cp_async(Thread& t, void const* src, void* dst) {
  t.op = Op::kCpAsync, t.src = src, t.dst = dst, t.bytes = 16;
  park(t, State::kAtEvent);
}

void Cta::commit(Thread& t) {
  t.groups.push_back(std::move(t.open));
  t.open.clear();
}

void Cta::wait(Thread& t, int pending) {
  // cp.async.wait_all (N = 0) also commits the open copies; wait_group N leaves the newest N groups.
  if (pending == 0) { commit(t); }
  size_t const done = t.groups.size() > size_t(pending) ? t.groups.size() - size_t(pending) : 0;
  for (size_t g = 0; g < done; ++g) {
    for (Copy const& c : t.groups[g]) { land(t, c); }
  }
  t.groups.erase(t.groups.begin(), t.groups.begin() + long(done));
}

void Cta::barrier(Thread& t) {
  ++at_barrier_;
  park(t, State::kAtBarrier);
}

void Cta::vector_move(Thread& t, void const* src, void* dst, int bytes) {
  bool const src_shared = in_shared(src), dst_shared = in_shared(dst);
  auto on_stack = [&](void const* p) {
    auto const a = reinterpret_cast<uintptr_t>(p);
    return a >= reinterpret_cast<uintptr_t>(t.stack->lo()) && a + uintptr_t(bytes) <= reinterpret_cast<uintptr_t>(t.stack->hi());
  };
  if (src_shared && dst_shared) {
    finding(Check::kBadAddress, [&] { return std::string("bad_address: " + who(t.tid) + " moves shared to shared memory in one vector move, "
                                    "which no instruction does; " + where(t, Op::kVecStore)); });
    return;
  }
  if (src_shared || dst_shared) {
    // The register side must be this thread's own registers (its fiber stack).
    if (!on_stack(src_shared ? dst : src)) {
      finding(Check::kBadAddress, [&] { return std::string("bad_address: " + who(t.tid) + " moves between shared memory and a non-register "
                                      "address in one vector move; " + where(t, src_shared ? Op::kVecLoad : Op::kVecStore)); });
      return;
    }
    t.op = src_shared ? Op::kVecLoad : Op::kVecStore;
    t.src = src, t.dst = dst, t.bytes = bytes;
    park(t, State::kAtEvent);
    return;
  }
  // Registers and global memory: executed on the thread.
  bool const src_global = !on_stack(src), dst_global = !on_stack(dst);
  for (auto [p, is_global, write] : {std::tuple{src, src_global, false}, std::tuple{static_cast<void const*>(dst), dst_global, true}}) {
    if (!is_global) { continue; }
    if (reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) != 0) {
      finding(Check::kBadAddress, [&] { return std::string("bad_address: " + who(t.tid) + " " + (write ? "stores" : "loads") + " a " +
                                      std::to_string(bytes) + "-byte vector at a global address not aligned to it; " +
                                      where(t, Op::kNone)); });
      return;
    }
    if (!global_ok(t, p, bytes, write, Op::kNone, write ? "vector store" : "vector load")) { return; }
  }
  std::memcpy(dst, src, size_t(bytes));
  if (src_global || dst_global) { ++report_->stats.global_vector; }
}

void Cta::clear_store(Thread& t, void* dst, int bytes) {
  uint32_t off = 0;
  if (!shared_offset(dst, bytes, off) || off % uint32_t(bytes) != 0) {
    finding(Check::kBadAddress, [&] { return std::string("bad_address: " + who(t.tid) + " zero-fills " + std::to_string(bytes) +
                                    " bytes outside shared memory or misaligned; " + where(t, Op::kClear)); });
    return;
  }
  shared_write(t, off, uint32_t(bytes), Op::kClear, false);
  std::memset(smem_ + off, 0, size_t(bytes));
  ++report_->stats.smem_clear;
}

void Cta::clear_done(Thread& t) {
  t.op = Op::kClear;
  park(t, State::kAtEvent);
}

void Cta::red_add(Thread& t, float* dst, float v) {
  if (reinterpret_cast<uintptr_t>(dst) % 4 != 0) {
    finding(Check::kBadAddress, [&] { return std::string("bad_address: " + who(t.tid) + " red.global.add.f32 at a misaligned address; " +
                                    where(t, Op::kNone)); });
    return;
  }
  if (!global_ok(t, dst, 4, true, Op::kNone, "red.global.add.f32")) { return; }
  // CTAs run on several CPU threads at once: the add itself must be atomic here too.
  std::atomic_ref<float>(*dst).fetch_add(v, std::memory_order_relaxed);
  ++report_->stats.red_global;
}

// ld.global / st.global of one scalar: executed on the thread, like the global side of a vector move.  The
// address must lie in one of the launch's tensors (writable for a store), aligned to the scalar's size.
void Cta::plain_global(Thread& t, void const* src, void* dst, int bytes, bool store) {
  void const* const g = store ? static_cast<void const*>(dst) : src;
  char const* const what = store ? "st.global" : "ld.global";
  if (in_shared(g) || reinterpret_cast<uintptr_t>(g) % uintptr_t(bytes) != 0) {
    finding(Check::kBadAddress, [&] { return std::string("bad_address: " + who(t.tid) + " " + what + " of " + std::to_string(bytes) +
                                    " bytes at a shared-memory or misaligned address; " + where(t, Op::kNone)); });
  } else if (global_ok(t, g, bytes, store, Op::kNone, what)) {
    std::memcpy(dst, src, size_t(bytes));
    ++report_->stats.global_plain;
    return;
  }
  if (!store) { std::memset(dst, 0, size_t(bytes)); }
}

Cta& cta_of(Thread& t) { return *t.cta; }

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Public entry points

void run_cta(KernelDesc const& kernel, CtaCoord const& cta, CtaBody body, void const* ctx, Report& report) {
  if (!tl_cta) { tl_cta = std::make_unique<Cta>(); }
  tl_cta->run(kernel, cta, body, ctx, report);
}

void ldmatrix_x4(bool trans, void const* row_address, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3) {
  Thread& t = self();
  uint32_t* d[4] = {&d0, &d1, &d2, &d3};
  cta_of(t).ldmatrix(t, 4, trans, row_address, d);
}

void ldmatrix_x2(void const* row_address, uint32_t& d0, uint32_t& d1) {
  Thread& t = self();
  uint32_t* d[4] = {&d0, &d1, nullptr, nullptr};
  cta_of(t).ldmatrix(t, 2, false, row_address, d);
}

void mma_m16n8k16(ptx::Type16 type, ptx::MmaLane const& operands, float& d0, float& d1, float& d2, float& d3) {
  Thread& t = self();
  float* d[4] = {&d0, &d1, &d2, &d3};
  cta_of(t).mma(t, type, operands, d);
}

float shfl_bfly(float value, int lane_mask, Site site) {
  Thread& t = self();
  t.site_what = "shfl_xor", t.site = site;
  return cta_of(t).shfl(t, value, lane_mask);
}

bool vote_any(bool value, Site site) {
  Thread& t = self();
  t.site_what = "warp_any", t.site = site;
  return cta_of(t).vote_any(t, value);
}

void cp_async_16(void const* global_src, void* shared_dst) {
  Thread& t = self();
  cta_of(t).cp_async(t, global_src, shared_dst);
}

void cp_async_commit(Site site) {
  Thread& t = self();
  t.site_what = "cp_async_fence", t.site = site;
  cta_of(t).commit(t);
}

void cp_async_wait(int pending_groups, Site site) {
  Thread& t = self();
  t.site_what = "cp_async_wait", t.site = site;
  cta_of(t).wait(t, pending_groups);
}

void barrier(Site site) {
  Thread& t = self();
  t.site_what = "barrier", t.site = site;
  cta_of(t).barrier(t);
}

void vector_move(void const* src, void* dst, int bytes) {
  Thread& t = self();
  cta_of(t).vector_move(t, src, dst, bytes);
}

void clear_store(void* shared_dst, int bytes) {
  Thread& t = self();
  cta_of(t).clear_store(t, shared_dst, bytes);
}

void clear_done(Site site) {
  Thread& t = self();
  t.site_what = "clear_smem", t.site = site;
  cta_of(t).clear_done(t);
}

void red_add_f32(float* global_dst, float value, Site site) {
  Thread& t = self();
  t.site_what = "atomic_add", t.site = site;
  cta_of(t).red_add(t, global_dst, value);
}

void global_load(void const* global_src, void* value, int bytes, Site site) {
  Thread& t = self();
  t.site_what = "load_global", t.site = site;
  cta_of(t).plain_global(t, global_src, value, bytes, false);
}

void global_store(void* global_dst, void const* value, int bytes, Site site) {
  Thread& t = self();
  t.site_what = "store_global", t.site = site;
  cta_of(t).plain_global(t, value, global_dst, bytes, true);
}

void note_site(char const* what, Site site) {
  Thread& t = self();
  t.site_what = what, t.site = site;
}

}  // namespace flash_ext::emu
