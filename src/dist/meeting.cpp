// How the ranks of a job meet at rank 0's store: see dist/meeting.h.

#include "dist/meeting.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <c10/util/StringUtil.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <thread>
#include <utility>

#include "dist/backend.h"
#include "text.h"

namespace gpipe::dist::detail {

namespace {

std::vector<uint8_t> bytes_of(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

// This process, told apart from any other that comes to a store: a
// random word drawn once (host and pid repeat across containers that
// share a host name, each pid 1).
const std::string& process_id() {
  static const std::string id = [] {
    std::random_device device;
    const uint64_t high = device();
    const uint64_t low = device();
    return std::to_string(
        (high << 32) ^ low ^ static_cast<uint64_t>(::getpid()));
  }();
  return id;
}

// Note [Meeting within the timeout]
// One deadline for the whole meeting: reaching the store, then every rank
// joining. c10d's server would wait for its workers with the whole timeout
// and then say nothing, and the Gloo group would wait the whole timeout
// again (rank 0 alone gave up after twice the timeout); instead every rank
// counts itself in under a key of ours and waits, until the deadline, for
// the verdict: "ok" from the last rank to come, or the reason the job
// cannot start, from the first rank that sees one (another WORLD_SIZE than
// the first rank's, a RANK that came twice), so that the others end at
// once, saying why, rather than at the deadline. The group is made once
// everyone is there, which takes no time.
//
// c10d's client waits for its store's replies without a limit, except
// after a wait(), which sets its socket's receive timeout and keeps it: a
// port that accepts and never answers (another service, a stopped rank 0)
// held a rank for ever. The meeting's first word is a wait for no key,
// which a store answers at once, under the deadline; every reply after it
// is bounded too.
class Meeting {
 public:
  Meeting(
      c10::intrusive_ptr<c10d::Store> store,
      int64_t rank,
      int64_t size,
      std::string where,
      std::chrono::steady_clock::time_point deadline,
      std::chrono::milliseconds timeout,
      bool hosts_store)
      : store_(std::move(store)),
        rank_(rank),
        size_(size),
        where_(std::move(where)),
        deadline_(deadline),
        timeout_(timeout),
        hosts_store_(hosts_store) {}

  void join() {
    ask("answer", [&] { store_->wait({}, left()); });
    const auto size = bytes_of(std::to_string(size_));
    std::vector<uint8_t> first;
    ask("agree on WORLD_SIZE",
        [&] { first = store_->compareSet("world_size", {}, size); });
    if (first != size) {
      refuse(c10::str(
          "rank ",
          rank_,
          " came with WORLD_SIZE ",
          size_,
          ", but the first rank to come had WORLD_SIZE ",
          std::string(first.begin(), first.end()),
          "; start every rank with the same WORLD_SIZE (gpipe-run: the same "
          "-n and --nnodes on every host)"));
    }
    int64_t came = 0;
    // Who came first as this RANK: a process that comes to the same store
    // again (a second World on the port of one whose store rank 0 still
    // holds) is told so, not that another process took its RANK.
    const auto me = bytes_of(process_id());
    std::vector<uint8_t> first_here;
    ask("count its RANK", [&] {
      first_here =
          store_->compareSet("rank_" + std::to_string(rank_) + "_by", {}, me);
      came = store_->add("rank_" + std::to_string(rank_), 1);
    });
    if (came > 1 && first_here == me) {
      refuse(c10::str(
          "this process came as RANK ",
          rank_,
          " of ",
          size_,
          " to the store at ",
          where_,
          " before: that store (of a World made earlier on this port) is "
          "still held by rank 0's process, so this World met it instead of a "
          "new one; give each new World another MASTER_PORT, on every rank "
          "(gpipe-run --master-port)"));
    }
    if (came > 1) {
      refuse(c10::str(
          "two processes came as RANK ",
          rank_,
          " of ",
          size_,
          "; give each process a RANK of its own (gpipe-run: another "
          "--node-rank on each host)"));
    }
    int64_t joined = 0;
    ask("count itself in", [&] { joined = store_->add("joined", 1); });
    if (joined == size_) {
      ask("say that all came", [&] { give_verdict(kAllCame); });
    }
    std::vector<uint8_t> verdict;
    try {
      store_->wait({"verdict_given"}, left());
      verdict = store_->get("verdict");
    } catch (const std::exception&) {
      int64_t now = 0;
      try {
        now = store_->add("joined", 0);
      } catch (...) {
        // (The store went away: the count stays unknown.)
      }
      gpipe::detail::fail_without_backtrace(c10::str(
          "gpipe::dist::init_from_env: rank ",
          rank_,
          " waited ",
          timeout_.count() / 1000.0,
          " s at ",
          where_,
          ", but ",
          now > 0 ? "only " + std::to_string(now) : std::string("not all"),
          " of the ",
          size_,
          " ranks (WORLD_SIZE) came; start the others, or check that they "
          "have the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE"));
    }
    const std::string said(verdict.begin(), verdict.end());
    if (said == kAllCame) {
      // Every reply from now on may take the whole timeout again (the last
      // wait left the socket's limit at what was left of the deadline).
      ask("answer", [&] { store_->wait({}, timeout_); });
      return;
    }
    try {
      store_->add("verdict_read", 1);
    } catch (...) {
      // (The store went away: nobody waits for this rank to read.)
    }
    linger();
    gpipe::detail::fail_without_backtrace(c10::str(
        "gpipe::dist::init_from_env: rank ",
        rank_,
        " cannot join the job at ",
        where_,
        ": ",
        said));
  }

 private:
  static constexpr const char* kAllCame = "all came";

  std::chrono::milliseconds left() const {
    return std::max(
        std::chrono::milliseconds(1),
        std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline_ - std::chrono::steady_clock::now()));
  }

  // The first verdict given stands; a compareSet wakes no waiter, a set
  // does.
  void give_verdict(const std::string& verdict) {
    store_->compareSet("verdict", {}, bytes_of(verdict));
    store_->set("verdict_given", {1});
  }

  // The store lives in the process of the rank that hosts it: when the
  // job cannot start, that rank stays (a few seconds at most) until every
  // rank that counted itself in has read why, rather than taking the
  // verdict with it.
  void linger() {
    if (!hosts_store_) {
      return;
    }
    const auto until = std::min(
        deadline_, std::chrono::steady_clock::now() + std::chrono::seconds(3));
    try {
      while (std::chrono::steady_clock::now() < until) {
        const auto joined = store_->add("joined", 0);
        const auto read = store_->add("verdict_read", 0);
        if (read >= joined) {
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } catch (...) {
      // (Nothing more to wait for.)
    }
  }

  // Runs one exchange with the store; a store that does not answer, or
  // answers nonsense, is named as such.
  template <typename F>
  void ask(const char* what, F&& exchange) {
    try {
      exchange();
    } catch (const std::exception&) {
      gpipe::detail::fail_without_backtrace(c10::str(
          "gpipe::dist::init_from_env: rank ",
          rank_,
          " reached ",
          where_,
          ", but no store answered there (asked to ",
          what,
          ") within ",
          timeout_.count() / 1000.0,
          " s: MASTER_PORT may be another service's, or rank 0's process "
          "stopped [c10d: ",
          message_of(std::current_exception()).substr(0, 300),
          "]"));
    }
  }

  // The job cannot start: says why to the ranks that wait (the first reason
  // given wins), then here.
  [[noreturn]] void refuse(const std::string& why) {
    try {
      give_verdict(why);
    } catch (...) {
      // (The others then end at the deadline.)
    }
    linger();
    gpipe::detail::fail_without_backtrace(
        c10::str("gpipe::dist::init_from_env: ", why));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int64_t rank_;
  int64_t size_;
  std::string where_;
  std::chrono::steady_clock::time_point deadline_;
  std::chrono::milliseconds timeout_;
  bool hosts_store_;
};

}  // namespace

void meet(
    c10::intrusive_ptr<c10d::Store> store,
    int64_t rank,
    int64_t size,
    std::string where,
    std::chrono::steady_clock::time_point deadline,
    std::chrono::milliseconds timeout,
    bool hosts_store) {
  Meeting(
      std::move(store),
      rank,
      size,
      std::move(where),
      deadline,
      timeout,
      hosts_store)
      .join();
}

// Note [A second rank 0]
// Two processes that come as RANK 0 (two hosts both left at --node-rank 0)
// cannot both host the store: the second cannot listen on the port and
// says so at once, but the first waited out the whole timeout for a rank
// that never came, and then blamed the ranks that did not start. So the
// second, before it fails, counts itself in at the first's store as a rank
// 0 would: when the store is a meeting of a job of its WORLD_SIZE, that
// rank 0 has come twice, and the verdict ends the first (and any rank
// already waiting) at once, saying why. The store of a job of another
// size, or of another service, is left as it was; a meeting already over
// keeps its verdict (the first given stands).
bool tell_a_first_rank_0(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t size) {
  try {
    // The first rank to come sets it at once; no key is made here.
    store->wait({"world_size"});
    if (store->get("world_size") != bytes_of(std::to_string(size))) {
      return false;
    }
    if (store->add("rank_0", 1) < 2) {
      return false;  // the first counts itself in after this, and refuses
    }
    store->compareSet(
        "verdict",
        {},
        bytes_of(c10::str(
            "two processes came as RANK 0 of ",
            size,
            "; give each process a RANK of its own (gpipe-run: another "
            "--node-rank on each host)")));
    store->set("verdict_given", {1});
    return true;
  } catch (const std::exception&) {
    return false;  // no store that answers: nothing to tell
  }
}

// Note [c10d's lines on a failed connect]
// A rank that cannot reach rank 0's store gets gpipe's one-line error,
// which carries c10d's own words; c10d also logged them, as lines of its
// own before it ("WARNING: Logging before InitGoogleLogging() is written to
// STDERR" and "E1129 ... socket.cpp:860] [c10d] The client socket has timed
// out ..."). While the store is made those lines are held back: a
// LibTorch built with glog (Debian's) reads glog's minloglevel, which is
// looked up by name so that gpipe need not link glog itself; one built
// without reads c10's caffe2_log_level. Only FATAL lines pass (level 3 in
// both), and the levels come back when the store is made or has failed.
QuietLibTorchLog::QuietLibTorchLog()
    : glog_level_(static_cast<int*>(
          ::dlsym(RTLD_DEFAULT, "_ZN3fLI17FLAGS_minloglevelE"))),
      saved_c10_level_(FLAGS_caffe2_log_level) {
  constexpr int kFatal = 3;
  if (glog_level_ != nullptr) {
    saved_glog_level_ = *glog_level_;
    *glog_level_ = std::max(saved_glog_level_, kFatal);
  }
  FLAGS_caffe2_log_level = std::max(saved_c10_level_, kFatal);
}

QuietLibTorchLog::~QuietLibTorchLog() {
  if (glog_level_ != nullptr) {
    *glog_level_ = saved_glog_level_;
  }
  FLAGS_caffe2_log_level = saved_c10_level_;
}

}  // namespace gpipe::dist::detail
