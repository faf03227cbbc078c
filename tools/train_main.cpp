// gpipe-train's command line: its flags parsed and checked, the run, and
// its errors' one line and exit status (the run itself: tools/train.cpp).

#include "train_main.h"

#include <torch/torch.h>

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
    return gpipe_train::train(args);
  } catch (...) {
    return report_error(std::current_exception());
  }
}
