// The fake driver's internal thread, where user-object destructors run (posted by
// release_user_object_locked, fake_capture.cpp), and the counts of calls made from it. The
// class stays internal to this file, so that nothing of it is exported (GCC exports the
// std::thread state of a lambda in an inline function of a header's class, even hidden);
// the other files reach it through the two functions at the end.

#include "fake_state.hpp"

#include <cuda.h>

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

namespace [[gnu::visibility("hidden")]] fake_cuda {

// --- the driver's internal thread: user-object destructors run there --------------------------

// The real driver runs user-object destructors asynchronously on an internal thread, and they
// may not call CUDA. The fake does the same with one worker and a queue, so a test sees a
// destructor that assumed it runs on the releasing thread, or that calls the driver.
[[gnu::tls_model("initial-exec")]] thread_local bool on_driver_thread = false;
std::atomic<long long> destructors_run{0};
std::atomic<long long> driver_thread_violations{0};

namespace {

class driver_thread {
 public:
  // Built after S(), so destroyed before it: no destructor still running can outlive the state.
  driver_thread() { (void)S(); }

  // Joined at library unload (process exit: the library is never closed), after the queue is
  // drained, so the sanitizers see no thread left running. A forked child has no worker.
  ~driver_thread() {
    if (worker_ == nullptr || owner_ != ::getpid()) return;
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    work_.notify_all();
    worker_->join();
    delete worker_;
  }

  void post(CUhostFn fn, void* arg) {
    std::lock_guard lock(m_);
    if (worker_ == nullptr) {  // started on first use: tests without user objects start no thread
      owner_ = ::getpid();
      worker_ = new std::thread([this] { run(); });
    }
    queue_.emplace_back(fn, arg);
    work_.notify_one();
  }

  void quiesce() {
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return queue_.empty() && !running_; });
  }

 private:
  void run() {
    on_driver_thread = true;
    std::unique_lock lock(m_);
    for (;;) {
      work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      auto [fn, arg] = queue_.front();
      queue_.pop_front();
      running_ = true;
      lock.unlock();  // a destructor may take its own locks, or post (through a release) again
      fn(arg);
      ++destructors_run;
      lock.lock();
      running_ = false;
      if (queue_.empty()) idle_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable work_;
  std::condition_variable idle_;
  std::deque<std::pair<CUhostFn, void*>> queue_;
  bool running_ = false;
  bool stopping_ = false;
  std::thread* worker_ = nullptr;  // a pointer, so a forked child can leave it unjoined
  pid_t owner_ = 0;
};

driver_thread& D() {
  static driver_thread d;
  return d;
}

}  // namespace

// For the other files, which cannot name the class: what they ask of the driver thread.
void post_to_driver_thread(CUhostFn fn, void* arg) { D().post(fn, arg); }
void quiesce_driver_thread() { D().quiesce(); }

}  // namespace fake_cuda
