#pragma once

// Runs a test case in a child process, so that a fault, a lost context or a hang fails the case
// by name instead of ending the test run.
//
// The child (`<binary> --child <case>`, a body defined with CHILD_CASE) exits 0 when every check
// passed and otherwise with the number of the first failed check (numbered within each case,
// printed with what went wrong on stderr); 60 is an unexpected exception, 70 a CUDA call that
// failed outside the checks that look for faults. A 60 s watchdog (alarm) turns a hang into
// SIGALRM. The parent's doctest case (expect_child_passes) runs the child, prints its output and
// reports its exit status or signal.

#include <doctest/doctest.h>

#include "gpu_support.hpp"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace streamalloc_test {

inline constexpr unsigned watchdog_s = 60;
inline constexpr int code_uncaught = 60;  // an exception no check expected
inline constexpr int code_cuda = 70;      // a CUDA call failed outside the checks that look for faults

// --- reporting, in the child ---------------------------------------------------------------------

/// A failed check: the child exits with `code`.
struct check_failed {
  int code;
};

__attribute__((format(printf, 1, 2))) inline std::string strf(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// Notes and failures go to stderr, unbuffered: a child killed by a signal still leaves them.
__attribute__((format(printf, 1, 2))) inline void note(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "  note: %s\n", buf);
}

[[noreturn]] inline void fail(int code, const std::string& what) {
  std::fprintf(stderr, "  FAILED check %d: %s\n", code, what.c_str());
  throw check_failed{code};
}

#define CHILD_EXPECT(cond, code, what)                                                                             \
  do {                                                                                                             \
    if (!(cond)) ::streamalloc_test::fail((code), std::string(#cond) + " is false: " + std::string(what));         \
  } while (0)

inline void cuda_ok(cudaError_t e, const char* call, int line, int code) {
  if (e != cudaSuccess) {
    fail(code, strf("line %d: %s -> %s: %s", line, call, cudaGetErrorName(e), cudaGetErrorString(e)));
  }
}
#define CHILD_CUDA(call) ::streamalloc_test::cuda_ok((call), #call, __LINE__, ::streamalloc_test::code_cuda)
// A kernel launch reports a bad configuration only through the last error.
#define CHILD_LAUNCHED(what) \
  ::streamalloc_test::cuda_ok(cudaGetLastError(), what, __LINE__, ::streamalloc_test::code_cuda)

/// Runs `fn`; the code of the check that failed in it, 0 if none.
inline int guarded(const std::function<void()>& fn) noexcept {
  try {
    fn();
    return 0;
  } catch (const check_failed& f) {
    return f.code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "  FAILED: unexpected exception: %s\n", e.what());
    return code_uncaught;
  } catch (...) {
    std::fprintf(stderr, "  FAILED: unexpected exception of an unknown type\n");
    return code_uncaught;
  }
}

/// Runs `fn` on a thread of its own (with its own per-thread default stream) and waits for it;
/// a check that failed there fails here.
inline void on_new_thread(const std::function<void()>& fn) {
  int code = 0;
  std::thread t([&] { code = guarded(fn); });
  t.join();
  if (code != 0) throw check_failed{code};
}

inline int run_case(const char* name, void (*body)()) {
  ::alarm(watchdog_s);  // a wait that never ends kills the child with SIGALRM: a failure, not a stuck run
  std::fprintf(stderr, "case %s\n", name);
  const int code = guarded([&] {
    CHILD_CUDA(cudaSetDevice(0));
    body();
  });
  std::fprintf(stderr, "case %s: %s\n", name, code == 0 ? "passed" : "FAILED");
  return code;
}

// Defines the body of child `name`, registered as `<binary> --child name`. Use it in an unnamed
// namespace: the functions it defines belong to one test binary.
#define CHILD_CASE(name)                                                                     \
  void name##_body();                                                                        \
  int name##_main(int, char**) { return ::streamalloc_test::run_case(#name, name##_body); }  \
  const ::streamalloc_test::register_child name##_registration(#name, name##_main);          \
  void name##_body()

// --- checks on exceptions, in the child ----------------------------------------------------------

template <class F>
void expect_throws_logic_error(int code, const char* call, F&& f) {
  std::fprintf(stderr, "  calling %s\n", call);  // names the call if it crashes the child
  try {
    f();
  } catch (const std::logic_error& e) {
    note("%s threw: %s", call, e.what());
    return;
  } catch (const std::exception& e) {
    fail(code, strf("%s threw \"%s\", which is not a std::logic_error", call, e.what()));
  }
  fail(code, strf("%s did not throw", call));
}

template <class E, class F>
void expect_throws(int code, const char* call, F&& f) {
  try {
    f();
  } catch (const E& e) {
    note("%s threw as it should: %s", call, e.what());
    return;
  } catch (const std::exception& e) {
    fail(code, strf("%s threw \"%s\", not the exception expected", call, e.what()));
  }
  fail(code, strf("%s did not throw", call));
}

/// Any exception will do (which one is the driver's business), as long as nothing crashes.
template <class F>
void expect_throws_something(int code, const char* call, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    note("%s threw as it should: %s", call, e.what());
    return;
  }
  fail(code, strf("%s did not throw", call));
}

// --- the parent: one doctest case per child ------------------------------------------------------

struct child_result {
  int status = 0;
  std::string output;
};

/// Runs `<binary> --child name` with stdout and stderr gathered, and waits for it.
inline child_result run_child(const std::string& name) {
  int fds[2] = {-1, -1};
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);  // the child's copies (dup2 onto 1 and 2) stay open
  posix_spawn_file_actions_t actions;
  REQUIRE(::posix_spawn_file_actions_init(&actions) == 0);
  ::posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  ::posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  std::string flag = "--child", child_name = name;
  std::vector<char*> args{const_cast<char*>(self_path), flag.data(), child_name.data(), nullptr};
  pid_t pid = 0;
  const int spawned = ::posix_spawn(&pid, self_path, &actions, nullptr, args.data(), environ);
  ::posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (spawned != 0) ::close(fds[0]);
  REQUIRE_MESSAGE(spawned == 0, "posix_spawn: " << std::strerror(spawned));
  child_result r;
  char buf[4096];
  for (;;) {
    const ssize_t got = ::read(fds[0], buf, sizeof buf);
    if (got > 0) {
      r.output.append(buf, static_cast<std::size_t>(got));
    } else if (got == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  while (::waitpid(pid, &r.status, 0) < 0) {
    REQUIRE(errno == EINTR);
  }
  return r;
}

/// The doctest side of a child case: runs it, prints its output, and fails with its signal or
/// the number of its failed check.
inline void expect_child_passes(const char* name_cstr) {
  const child_result r = run_child(name_cstr);
  const std::string name = name_cstr;  // doctest's message builder prints a char* as a pointer
  std::printf("---- child %s ----\n%s---- end of child %s ----\n", name.c_str(), r.output.c_str(), name.c_str());
  std::fflush(stdout);
  if (WIFSIGNALED(r.status)) {
    const int sig = WTERMSIG(r.status);
    FAIL_CHECK("case " << name << ": the child was killed by signal " << sig << " (" << std::string(::strsignal(sig)) << ")"
                       << (sig == SIGALRM ? ": the watchdog fired, something hung" : "")
                       << "; its output is printed above");
    return;
  }
  REQUIRE(WIFEXITED(r.status));
  CHECK_MESSAGE(WEXITSTATUS(r.status) == 0, "case " << name << ": failed check " << WEXITSTATUS(r.status)
                                                    << " (60: unexpected exception, 70: a CUDA call failed); "
                                                    << "its output is printed above");
}

// --- processes that work together --------------------------------------------------------------

/// A child process of this binary (`<binary> --child name args...`) that talks over its stdin and
/// stdout, for tests whose processes work together (IPC, one NCCL rank per process).
struct piped_child {
  pid_t pid = -1;
  int to = -1, from = -1;

  piped_child(const char* name, std::vector<std::string> args) {
    ::signal(SIGPIPE, SIG_IGN);  // a child that failed early closes its stdin: an error, not a signal
    int in[2], out[2];
    REQUIRE(::pipe2(in, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t actions;
    ::posix_spawn_file_actions_init(&actions);
    ::posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
    ::posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    std::vector<std::string> all{self_path, "--child", name};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int r = ::posix_spawn(&pid, self_path, &actions, nullptr, argv.data(), environ);
    ::posix_spawn_file_actions_destroy(&actions);
    ::close(in[0]);
    ::close(out[1]);
    to = in[1];
    from = out[0];
    REQUIRE_MESSAGE(r == 0, "posix_spawn: " << std::strerror(r));
  }
  ~piped_child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      (void)wait();
    }
    ::close(to);
    ::close(from);
  }
  /// The next line the child prints ("" when it has exited).
  std::string line() {
    std::string s;
    char c;
    while (::read(from, &c, 1) == 1 && c != '\n') s += c;
    return s;
  }
  void say(const char* word) { REQUIRE(::write(to, word, std::strlen(word)) > 0); }
  /// Exit status (or 128 + signal).
  int wait() {
    int status = 0;
    ::waitpid(pid, &status, 0);
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

}  // namespace streamalloc_test
