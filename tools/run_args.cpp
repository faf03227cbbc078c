// gpipe-run's command line (see run_args.h).

#include "run_args.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <string>
#include <system_error>
#include <vector>

#include "cli_message.h"

namespace gpipe_run {
namespace {

// CLI11 reads integers with strtoll's base 0 and saturates ("0x10" is 16,
// "99999999999999999999" INT64_MAX), so the flags are read as text and
// converted here: plain decimals in [low, high] only.
int64_t parse_integer(
    const std::string& flag,
    const std::string& text,
    int64_t low,
    int64_t high,
    const std::string& what) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [rest, error] = std::from_chars(text.data(), end, value);
  const bool in_range = !text.empty() && error == std::errc() && rest == end &&
                        value >= low && value <= high;
  usage_check(
      in_range,
      flag,
      " expects ",
      what,
      ", a decimal integer from ",
      low,
      " to ",
      high,
      ", but got '",
      text,
      "'");
  return value;
}

double parse_seconds(const std::string& flag, const std::string& text) {
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [rest, error] = std::from_chars(text.data(), end, value);
  const bool valid = !text.empty() && error == std::errc() && rest == end &&
                     std::isfinite(value) && value >= 0 &&
                     value <= kMaxGraceSeconds;
  usage_check(
      valid,
      flag,
      " expects a number of seconds from 0 to ",
      kMaxGraceSeconds,
      ", but got '",
      text,
      "'");
  return value;
}

// --master-addr is resolved once, here, as the ranks' TCPStore clients will
// resolve it (any address family, TCP). Otherwise a typo starts every rank,
// and each one's c10d client retries the name with a warning a second until
// its rendezvous times out.
void check_master_addr(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int error = ::getaddrinfo(addr.c_str(), nullptr, &hints, &found);
  const int system_error = errno;
  if (found != nullptr) {
    ::freeaddrinfo(found);
  }
  usage_check(
      error == 0,
      "--master-addr expects a host name or address that resolves, but '",
      addr,
      "' does not (",
      error == EAI_SYSTEM ? std::strerror(system_error) : ::gai_strerror(error),
      ")");
}

// CLI11's help, with our usage line rather than "gpipe-run [OPTIONS]" (the
// `--` and the program are not CLI11 options: see parse_args).
class RunFormatter : public CLI::Formatter {
 public:
  std::string make_usage(
      const CLI::App* /*app*/, std::string /*name*/) const override {
    return std::string("Usage: ") + kUsage + "\n";
  }
};

constexpr const char* kFooter =
    "Every rank gets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK\n"
    "and LOCAL_WORLD_SIZE in its environment, /dev/null as its input, and\n"
    "its own process group. Its output lines come out prefixed with '[RANK] '\n"
    "(standard output to standard output, standard error to standard error).\n"
    "\n"
    "When a rank exits non-zero or is killed, or gpipe-run gets SIGINT,\n"
    "SIGTERM or SIGHUP, the ranks still running get SIGTERM, then SIGKILL\n"
    "after --grace seconds (or at a second SIGINT). gpipe-run prints every\n"
    "rank's output to its end, also what a rank's process group writes\n"
    "after the rank itself has exited, and then one last line naming the\n"
    "rank that failed first (the first to exit) and the ranks it stopped.\n"
    "\n"
    "With --max-restarts R, a failure does not end the job at once: once\n"
    "every rank has stopped, all of them start again (on a new free port\n"
    "unless --master-port is given), at most R times; GPIPE_RESTART_COUNT\n"
    "(also TORCHELASTIC_RESTART_COUNT) tells them which start they are.\n"
    "A program that saves checkpoints resumes from them (gpipe-train\n"
    "--save DIR --resume). A rank that fails first with exit status 2 (a\n"
    "command-line error) is not started again. The last line says how many\n"
    "restarts were used.\n"
    "\n"
    "Exit status: 0 when every rank exits 0; the first failing rank's exit\n"
    "code, or 128 + its signal (of the last start); 128 + the signal\n"
    "gpipe-run got; 127 when\n"
    "PROGRAM cannot be executed (never restarted); 2 for a bad command line;\n"
    "1 when gpipe-run itself fails.\n"
    "\n"
    "Several hosts: run gpipe-run on each, with the same --nnodes, -n,\n"
    "--master-addr (host 0's address, as the others reach it) and\n"
    "--master-port, and --node-rank 0 to --nnodes - 1. Host K starts ranks\n"
    "K*N to K*N+N-1 of --nnodes * N; rank 0, on host 0, hosts the\n"
    "rendezvous. gpipe-run sees only its own host's ranks: when another\n"
    "host fails or never comes, its ranks fail by themselves (their\n"
    "rendezvous timeout, GPIPE_DIST_TIMEOUT for gpipe's programs) and it\n"
    "stops the rest as above. To stop such a job, stop every host: the\n"
    "others take one stopped host for a failure, and restart.";

}  // namespace

// Note [Splitting at --]
// CLI11 would also take the program and its arguments as positionals without
// a `--`, and it would read any flag among them that looks like one of ours
// (`gpipe-run -n 2 python train.py -n 5`). So gpipe-run splits argv at the
// first `--` itself: CLI11 sees only what comes before it, and what follows
// is the command, verbatim. A `--` is required, as in the usage line.
bool parse_args(int argc, const char* const* argv, Args& args) {
  int split = 1;
  while (split < argc && std::strcmp(argv[split], "--") != 0) {
    ++split;
  }
  const bool has_separator = split < argc;

  CLI::App app{
      "Start N processes of PROGRAM on this machine, ranks 0 to N-1 of one "
      "job (or of one host's share of a job on several hosts), as torchrun "
      "does for PyTorch",
      "gpipe-run"};
  app.formatter(std::make_shared<RunFormatter>());
  app.footer(kFooter);
  // Unknown arguments are kept rather than refused by CLI11, so that the
  // error can say whether a flag is unknown or the `--` is missing.
  app.allow_extras();
  std::string processes_text;
  std::string nnodes_text;
  std::string node_rank_text;
  std::string port_text;
  std::string grace_text;
  std::string restarts_text;
  app.add_option(
         "-n",
         processes_text,
         "Processes to start on this machine, 1 to " +
             std::to_string(kMaxProcesses) +
             " (LOCAL_RANK 0 to N-1; RANK K*N to K*N+N-1 with --node-rank "
             "K). Required")
      ->type_name("N");
  app.add_option(
         "--nnodes",
         nnodes_text,
         "Hosts in the job, 1 to " + std::to_string(kMaxNodes) +
             ", each running gpipe-run with the same -n (WORLD_SIZE = "
             "NNODES * N). More than 1 needs --master-addr and --master-port. "
             "Default: 1")
      ->type_name("NNODES");
  // Also torchrun's spelling, so that its command lines carry over.
  app.add_option(
         "--node-rank,--node_rank",
         node_rank_text,
         "This host's index in the job, 0 to NNODES-1; host 0 runs rank 0, "
         "which hosts the rendezvous. Default: 0")
      ->type_name("K");
  app.add_option(
         "--master-addr",
         args.master_addr,
         "MASTER_ADDR for every rank: host 0's address; it must resolve on "
         "this machine (checked before any rank starts). Default: 127.0.0.1 "
         "(given explicitly with --nnodes > 1)")
      ->type_name("ADDR");
  app.add_option(
         "--master-port",
         port_text,
         "MASTER_PORT for every rank, 1 to 65535. Default: a free port on "
         "127.0.0.1, found at start (given explicitly with --nnodes > 1)")
      ->type_name("PORT");
  app.add_option(
         "--grace",
         grace_text,
         "Seconds the ranks get between SIGTERM and SIGKILL when stopping, "
         "0 to 3600. Default: 5")
      ->type_name("SECONDS");
  // Also torchrun's spelling.
  app.add_option(
         "--max-restarts,--max_restarts",
         restarts_text,
         "Start every rank again after a rank fails, at most this many times, "
         "0 to " +
             std::to_string(kMaxRestarts) +
             ". Default: 0 (a failure ends the job)")
      ->type_name("R");

  try {
    app.parse(split, argv);
  } catch (const CLI::ParseError& e) {
    // --help is a ParseError too, with exit code 0: let CLI11 print it.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      app.exit(e);
      return false;
    }
    throw UsageError(
        gpipe::tools::cli_message(e, &app) + " (see gpipe-run --help)");
  }

  const auto extras = app.remaining();
  for (const auto& extra : extras) {
    usage_check(
        extra.empty() || extra[0] != '-',
        "unknown flag '",
        extra,
        "' (see gpipe-run --help)");
  }
  // Checked here rather than by CLI11, to say what N is.
  usage_check(
      app.count("-n") > 0,
      "-n N is required: the number of processes to start; the usage is ",
      kUsage);
  args.processes = parse_integer(
      "-n", processes_text, 1, kMaxProcesses, "the number of processes");
  if (app.count("--nnodes") > 0) {
    args.nnodes = parse_integer(
        "--nnodes", nnodes_text, 1, kMaxNodes, "the number of hosts");
  }
  if (app.count("--node-rank") > 0) {
    args.node_rank = parse_integer(
        "--node-rank",
        node_rank_text,
        0,
        args.nnodes - 1,
        "this host's index among --nnodes " + std::to_string(args.nnodes) +
            " hosts");
  }
  usage_check(
      !args.master_addr.empty(),
      "--master-addr needs an address, such as 127.0.0.1");
  if (app.count("--master-port") > 0) {
    args.master_port = static_cast<int>(
        parse_integer("--master-port", port_text, 1, 65535, "a TCP port"));
  }
  if (app.count("--grace") > 0) {
    args.grace_seconds = parse_seconds("--grace", grace_text);
  }
  if (app.count("--max-restarts") > 0) {
    args.max_restarts = parse_integer(
        "--max-restarts",
        restarts_text,
        0,
        kMaxRestarts,
        "how many times to restart the ranks");
  }
  // Every host's ranks must meet at one address and port, which the hosts
  // cannot agree on by themselves: a free port found here is free only
  // here, and 127.0.0.1 names each host itself.
  usage_check(
      args.nnodes == 1 || app.count("--master-port") > 0 ||
          app.count("--master-addr") > 0,
      "--nnodes ",
      args.nnodes,
      " needs --master-addr and --master-port: host 0's address and a port, "
      "the same on every host");
  usage_check(
      args.nnodes == 1 || app.count("--master-port") > 0,
      "--nnodes ",
      args.nnodes,
      " needs --master-port: every host must give its ranks the same port, "
      "and a free port found on one host is unknown to the others");
  usage_check(
      args.nnodes == 1 || app.count("--master-addr") > 0,
      "--nnodes ",
      args.nnodes,
      " needs --master-addr: host 0's address, the same on every host (the "
      "default, 127.0.0.1, reaches only this host)");

  if (!extras.empty()) {
    usage_check(
        has_separator,
        "missing '--' before the program '",
        extras.front(),
        "'; the usage is ",
        kUsage);
    usage_check(
        false,
        "unexpected argument '",
        extras.front(),
        "' before '--'; the program and its arguments go after '--'");
  }
  usage_check(
      has_separator,
      "missing '--' and the program after it; the usage is ",
      kUsage);
  usage_check(
      split + 1 < argc && argv[split + 1][0] != '\0',
      "missing the program after '--'; the usage is ",
      kUsage);
  args.command.assign(argv + split + 1, argv + argc);
  // Last: the only check that may wait (on DNS).
  check_master_addr(args.master_addr);
  return true;
}

}  // namespace gpipe_run
