// gpipe-train's command line: its flags parsed and checked, the run, and
// its errors' one line and exit status (the run itself: tools/train.cpp).

#include "train_main.h"

#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <iostream>

#include "cli_message.h"
#include "train_args.h"

// The exit status of the run's error `error` (a UsageError: 2, else 1),
// printed on one line.
int gpipe_train::report_error(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const UsageError& e) {
    std::cerr << "gpipe-train: " << one_line(e.what()) << std::endl;
    return kUsageExit;
  } catch (const c10::Error& e) {
    std::cerr << "gpipe-train: " << one_line(e.what_without_backtrace())
              << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "gpipe-train: " << one_line(e.what()) << std::endl;
  } catch (...) {
    std::cerr << "gpipe-train: an exception of an unknown type" << std::endl;
  }
  return 1;
}

namespace {

// Whether what the run printed on standard output got there. A pipe or a
// socket whose reader closed it (`gpipe-train | head -1`) has what it
// wanted: the rest is dropped without a word. A file or a device that
// failed a write (a full disk) lost the run's results: then the run fails,
// as with --json.
bool output_written() {
  std::cout.flush();
  const bool failed =
      !std::cout.good() || std::fflush(stdout) != 0 || std::ferror(stdout) != 0;
  struct stat st {};
  if (!failed || ::fstat(STDOUT_FILENO, &st) != 0) {
    return true;
  }
  return S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode);
}

}  // namespace

int gpipe_train::train_main(int argc, char** argv) {
  // Standard output line by line, set before anything is written to it: it
  // is fully buffered into a pipe or a file, so a launcher showed the
  // epochs' results at the end, and a rank killed lost the lines of the
  // checkpoints it had saved. (Standard error is unbuffered.)
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  CLI::App app{
      "Train a CNN, ResNet or U-Net on Fashion-MNIST with GPipe pipeline "
      "parallelism"};
  // --help shows every option's default beside it.
  app.option_defaults()->always_capture_default();
  Args args;
  add_options(app, args);
  add_save_options(app, args);
  add_devices_option(app, args);
  add_autotune_options(app, args);
  try {
    app.parse(argc, argv);
    if (const auto empty = gpipe::tools::empty_switch_value(app, argc, argv);
        !empty.empty()) {
      throw UsageError(empty + " (see gpipe-train --help)");
    }
    refuse_repeated_switches(app);
    args.world_size = world_size_from_env();
    // --autotune's first: a flag it chooses is refused as such, not by
    // another check of that flag.
    verify_autotune_options(app, args);
    verify_args(app, args);
    verify_save_options(app, args);
    verify_devices_option(app, args);
    args.balance_given = app.count("--balance") > 0;
  } catch (const CLI::ParseError& e) {
    // --help is a ParseError too, with exit code 0: let CLI11 print it. The
    // others get exit status 2 rather than CLI11's codes (above 100), and
    // one line rather than CLI11's two.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      return app.exit(e);
    }
    return report_error(std::make_exception_ptr(UsageError(c10::str(
        gpipe::tools::cli_message(e, &app), " (see gpipe-train --help)"))));
  } catch (const UsageError&) {
    return report_error(std::current_exception());
  }
  try {
    const int status = gpipe_train::train(args);
    if (status == 0 && !output_written()) {
      std::cerr << "gpipe-train: cannot write to standard output: the "
                   "run's results are lost"
                << std::endl;
      return 1;
    }
    return status;
  } catch (...) {
    return report_error(std::current_exception());
  }
}
