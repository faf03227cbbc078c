// A program of this project (gpipe-train's or gpipe-bench's: the same
// objects its binary is linked from, reached through program_main) run once
// per request in a child forked from this process, for the command-line
// tests (tests/train_cli_test.sh, tests/bench_cli_test.sh).
//
// Note [Forked command-line runs]
// A process linked with LibTorch takes about 0.4 s to start here, nearly
// all of it LibTorch's own start-up (relocations and static initializers;
// an empty main() linked with libtorch_cpu takes as long), and the
// command-line tests run the programs over a hundred times, each refused
// within a millisecond of its start. This process starts once; each run is a
// child forked from it before it has done anything else, which runs the
// program with the request's arguments, environment, standard output and
// standard error, and exits with its status as the binary's main() would.
// The child shares nothing with the runs before it, and ends without
// LibTorch's static destructors (run_child). The tests still run the
// binaries themselves for the cases a fork cannot stand for (another user,
// the failures gpipe-train once had: a signal, std::terminate) and a few
// more of each kind.
//
//   train_cli_forks PROGRAM   (or bench_cli_forks PROGRAM)
//
// PROGRAM is the binary's path, the runs' argv[0]. A request on standard
// input, as NUL-terminated fields: the file for the run's standard output,
// the file for its standard error, the number of environment entries, the
// entries (NAME=VALUE: the run's whole environment), the number of
// arguments, the arguments. The answer on standard output is one line: the
// exit status, or 128 + the signal that ended the run (as a shell says it).
// A run has 120 s (SIGALRM after that).

#include "cli_forks.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace {

// The next NUL-terminated field of standard input; false at its end.
bool read_field(std::string& field) {
  field.clear();
  while (true) {
    const int c = std::getchar();
    if (c == EOF) {
      return false;
    }
    if (c == '\0') {
      return true;
    }
    field.push_back(static_cast<char>(c));
  }
}

bool read_count(size_t& n) {
  std::string field;
  if (!read_field(field) || field.empty() ||
      field.find_first_not_of("0123456789") != std::string::npos ||
      field.size() > 6) {
    return false;
  }
  n = std::stoul(field);
  return true;
}

bool read_fields(size_t n, std::vector<std::string>& fields) {
  fields.resize(n);
  for (auto& field : fields) {
    if (!read_field(field)) {
      return false;
    }
  }
  return true;
}

[[noreturn]] void die(const std::string& what) {
  std::cerr << "cli_forks: " << what << std::endl;
  std::exit(1);
}

int threads_of_this_process() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry :
       std::filesystem::directory_iterator("/proc/self/task")) {
    ++n;
  }
  return n;
}

// In the child: the run's files and environment, then the program.
[[noreturn]] void run_child(
    const std::string& out,
    const std::string& err,
    const std::vector<std::string>& environment,
    std::vector<std::string>& args) {
  const int in = ::open("/dev/null", O_RDONLY);
  const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (in < 0 || o < 0 || e < 0 || ::dup2(in, 0) < 0 || ::dup2(o, 1) < 0 ||
      ::dup2(e, 2) < 0) {
    std::perror("cli_forks: the run's files");
    std::_Exit(125);
  }
  ::close(in);
  ::close(o);
  ::close(e);
  ::clearenv();
  for (const auto& entry : environment) {
    const auto eq = entry.find('=');
    if (eq == std::string::npos || eq == 0) {
      continue;
    }
    ::setenv(
        entry.substr(0, eq).c_str(),
        entry.substr(eq + 1).c_str(),
        /*overwrite=*/1);
  }
  std::vector<char*> argv;
  for (auto& arg : args) {
    argv.push_back(arg.data());
  }
  argv.push_back(nullptr);
  ::alarm(120);
  const int status = program_main(static_cast<int>(args.size()), argv.data());
  // What main()'s return does that a test can see: the streams flushed.
  // LibTorch's static destructors (its operators deregistered one by one,
  // about 90 ms of a forked run's 100) are left to the process's end.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(status);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    die("usage: cli_forks PROGRAM");
  }
  const std::string program = argv[1];
  while (true) {
    std::string out;
    std::string err;
    if (!read_field(out)) {
      return 0;  // standard input ended: no more requests
    }
    size_t n = 0;
    std::vector<std::string> environment;
    std::vector<std::string> args;
    if (!read_field(err) || !read_count(n) || !read_fields(n, environment) ||
        !read_count(n) || !read_fields(n, args)) {
      die("a request that is not OUT, ERR, N, N entries, N, N arguments");
    }
    // A fork copies only the thread that calls it: with another thread
    // alive (none should be: this process has run nothing), a lock it held
    // would stay held in the child.
    if (threads_of_this_process() != 1) {
      die("more than one thread before a fork");
    }
    args.insert(args.begin(), program);
    std::fflush(nullptr);
    const pid_t child = ::fork();
    if (child < 0) {
      die(std::string("fork: ") + std::strerror(errno));
    }
    if (child == 0) {
      run_child(out, err, environment, args);
    }
    int status = 0;
    while (::waitpid(child, &status, 0) < 0) {
      if (errno != EINTR) {
        die(std::string("waitpid: ") + std::strerror(errno));
      }
    }
    const int code =
        WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::cout << code << std::endl;
  }
}
