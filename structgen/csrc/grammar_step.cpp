// Grammar mask fills (and a decode step's token accepts) of a batch of xgrammar matchers on a
// persistent pool of native threads.
//
// A large batch's decode step can be host-bound on filling masks on one core: xgrammar's own
// batch fill got slower with more threads, and Python threads hand the GIL back and forth
// (docs/performance.md, "Grammar overhead"). xgrammar 0.2's matchers are apache-tvm-ffi objects, so their methods can be
// called through tvm-ffi's C ABI from any thread: here a batch is one call from Python (ctypes
// releases the GIL for it), spread over workers that stay awake between decode steps.
//
// Plain C ABI (loaded with ctypes by structgen/grammar/native.py); no Python or torch headers,
// so it builds quickly with g++ on first use, CPU machines included.
//
// Rules: matchers in one call are distinct objects, and no other thread uses them meanwhile
// (different matchers of one compiled grammar may run on different threads; one matcher may
// not); the caller keeps them and the bitmask alive for the call. Calls may come from several
// threads at once: one batch has the pool, the others run on their own threads.

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/accessor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <pthread.h>
#include <string>
#include <thread>
#include <vector>

namespace {

using tvm::ffi::Function;
using tvm::ffi::ObjectRef;

// A pool whose workers stay awake for a while after each batch (a decode step comes back
// within a millisecond), then sleep on a condition variable. Work items are claimed with one
// 64-bit ticket: (generation << 32) | next index, so a worker that wakes late can never take
// an item of a later batch for one of an earlier batch.
class Pool {
 public:
  explicit Pool(int threads, int spin_us) : spin_us_(spin_us) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs job(i) for i in [0, n) on the pool and the calling thread; returns when all are done.
  // A call made while another thread's batch holds the pool runs on its own thread alone.
  void Run(int n, const std::function<void(int)>& job) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || workers_.empty() || n < 2) {
      for (int i = 0; i < n; ++i) job(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &job;
      done_.store(0, std::memory_order_relaxed);
      ++generation_;
      limit_.store((generation_ << 32) | static_cast<uint32_t>(n), std::memory_order_release);
      ticket_.store(generation_ << 32, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    Work(generation_ << 32);
    while (done_.load(std::memory_order_acquire) < n) std::this_thread::yield();
  }

 private:
  void Work(uint64_t gen_bits) {
    const uint64_t gen = gen_bits >> 32;
    // An item is claimed only while the ticket and the limit are both of this generation, so
    // a worker that read an earlier batch's state cannot claim an item of a later one.
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> 32) == gen) {
      const uint64_t limit = limit_.load(std::memory_order_acquire);
      if ((limit >> 32) != gen || static_cast<uint32_t>(t) >= static_cast<uint32_t>(limit)) return;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        (*job_)(static_cast<int>(static_cast<uint32_t>(t)));
        done_.fetch_add(1, std::memory_order_acq_rel);
        t = ticket_.load(std::memory_order_acquire);
      }
    }
  }

  void Loop() {
    uint64_t seen = 0;
    while (true) {
      // Spin a while for the next batch, then sleep.
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      uint64_t t = ticket_.load(std::memory_order_acquire);
      while ((t >> 32) == seen && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
        t = ticket_.load(std::memory_order_acquire);
      }
      if ((t >> 32) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleeping_.fetch_add(1, std::memory_order_acq_rel);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        if (stop_) return;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        seen = generation_;
      }
      Work(seen << 32);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // held by the batch that has the pool
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  bool stop_ = false;
  int spin_us_;
  std::atomic<uint64_t> ticket_{0}, limit_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleeping_{0};
};

struct Methods {
  Function fill_next_token_bitmask, accept_token, is_terminated, is_completed, find_jump_forward_string;
};

Methods* g_methods = nullptr;
Pool* g_pool = nullptr;
std::mutex g_error_mu;
std::string g_error;

void SetError(const std::string& what) {
  std::lock_guard<std::mutex> lock(g_error_mu);
  if (g_error.empty()) g_error = what;
}

ObjectRef Borrow(void* handle) {  // a new reference to an object the caller keeps alive
  return ObjectRef(tvm::ffi::details::ObjectUnsafe::ObjectPtrFromUnowned<tvm::ffi::Object>(
      static_cast<tvm::ffi::Object*>(handle)));
}

// xgrammar fills `fill_words` words of `row` (its tokenizer's vocabulary); the words past that
// (a model vocabulary padded beyond the tokenizer's) are set to 0. Throws what xgrammar throws.
void FillRow(void* matcher, int32_t* row, int64_t row_words, int64_t fill_words) {
  int64_t shape[1] = {fill_words};
  DLTensor t;
  std::memset(&t, 0, sizeof t);
  t.data = row;
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = DLDataType{kDLInt, 32, 1};
  t.shape = shape;
  g_methods->fill_next_token_bitmask(Borrow(matcher), &t, 0, false);
  if (fill_words < row_words) std::memset(row + fill_words, 0, (row_words - fill_words) * sizeof(int32_t));
}

// A forked child has none of the parent's workers, and a lock one of them held at the fork
// stays locked there: the child starts over with a pool of its own thread alone.
void AfterForkInChild() {
  g_pool = new Pool(1, 0);  // the parent's pool is leaked: its threads and locks are not ours
  new (&g_error_mu) std::mutex();
}

}  // namespace

extern "C" {

// Looks up the matcher type's fill method and starts `threads` - 1 workers. Returns 0, or -1
// with sg_take_error() saying why (an xgrammar whose matchers are not tvm-ffi objects, say).
int sg_init(const char* matcher_type_key, int threads, int spin_us) {
  static const int registered = pthread_atfork(nullptr, nullptr, AfterForkInChild);
  (void)registered;
  try {
    auto* m = new Methods();
    m->fill_next_token_bitmask = tvm::ffi::reflection::GetMethod(matcher_type_key, "fill_next_token_bitmask");
    m->accept_token = tvm::ffi::reflection::GetMethod(matcher_type_key, "accept_token");
    m->is_terminated = tvm::ffi::reflection::GetMethod(matcher_type_key, "is_terminated");
    m->is_completed = tvm::ffi::reflection::GetMethod(matcher_type_key, "is_completed");
    m->find_jump_forward_string = tvm::ffi::reflection::GetMethod(matcher_type_key, "find_jump_forward_string");
    delete g_methods;
    g_methods = m;
    delete g_pool;
    g_pool = new Pool(threads < 1 ? 1 : threads, spin_us);
    return 0;
  } catch (const std::exception& e) {
    SetError(e.what());
    return -1;
  }
}

int sg_threads() { return g_pool ? g_pool->threads() : 0; }

// The first error since the last call that cleared it ("" if none); clears it.
int sg_take_error(char* out, int size) {
  std::lock_guard<std::mutex> lock(g_error_mu);
  int n = static_cast<int>(g_error.size());
  if (size > 0) {
    int k = n < size - 1 ? n : size - 1;
    std::memcpy(out, g_error.data(), k);
    out[k] = '\0';
  }
  g_error.clear();
  return n;
}

// Fills row rows[i] of `bitmask` ([*, row_words] int32, row-major) from matcher i, on the pool.
// xgrammar writes `fill_words` words a row (its tokenizer's vocabulary); words past that (a
// model vocabulary padded beyond the tokenizer's) are set to 0. failed[i] = 1 where matcher i
// raised (its row is left as it was). Returns the number of failed rows.
int sg_fill(void* const* matchers, int n, int32_t* bitmask, int64_t row_words, int64_t fill_words,
            const int32_t* rows, uint8_t* failed) {
  if (g_methods == nullptr) {
    SetError("sg_init was not called");
    return n;
  }
  std::atomic<int> failures{0};
  std::function<void(int)> job = [&](int i) {
    try {
      FillRow(matchers[i], bitmask + static_cast<int64_t>(rows[i]) * row_words, row_words, fill_words);
      failed[i] = 0;
    } catch (const std::exception& e) {
      failed[i] = 1;
      failures.fetch_add(1);
      SetError(e.what());
    }
  };
  g_pool->Run(n, job);
  return failures.load();
}

// What sg_advance found for a row (bits of status[i]).
enum : uint8_t {
  kAccepted = 1,    // the matcher took the token
  kTerminated = 2,  // ... and it was a stop token: the matcher is done
  kCompleted = 4,   // the output so far is a complete match (more may follow)
  kJumps = 8,       // the grammar forces text next (non-empty jump-forward string)
  kFilled = 16,     // the next mask is in bitmask row rows[i]
  kFailed = 32,     // the matcher raised (sg_take_error says why); other bits are unreliable
};

// A decode step's tokens for a batch: matcher i accepts tokens[i] and reports on its new state
// in status[i]. Where it accepted and is not terminated: with check_jump, whether text is forced
// next; with a bitmask, its next mask is filled into row rows[i] (as sg_fill). The engine's
// per-row Python (accept, is-complete, jump check) becomes
// one GIL-free call spread over the pool, fused with the next step's fill.
int sg_advance(void* const* matchers, int n, const int32_t* tokens, int check_jump, int32_t* bitmask,
               int64_t row_words, int64_t fill_words, const int32_t* rows, uint8_t* status) {
  if (g_methods == nullptr) {
    SetError("sg_init was not called");
    return n;
  }
  std::atomic<int> failures{0};
  std::function<void(int)> job = [&](int i) {
    uint8_t st = 0;
    try {
      ObjectRef m = Borrow(matchers[i]);
      if (g_methods->accept_token(m, static_cast<int64_t>(tokens[i]), false).cast<bool>()) {
        st |= kAccepted;
        if (g_methods->is_terminated(m).cast<bool>()) {
          st |= kTerminated;
        } else {
          if (g_methods->is_completed(m).cast<bool>()) st |= kCompleted;
          if (check_jump && !g_methods->find_jump_forward_string(m).cast<tvm::ffi::String>().empty()) st |= kJumps;
          if (bitmask != nullptr) {
            FillRow(matchers[i], bitmask + static_cast<int64_t>(rows[i]) * row_words, row_words, fill_words);
            st |= kFilled;
          }
        }
      }
    } catch (const std::exception& e) {
      st = kFailed;
      failures.fetch_add(1);
      SetError(e.what());
    }
    status[i] = st;
  };
  g_pool->Run(n, job);
  return failures.load();
}

}  // extern "C"
